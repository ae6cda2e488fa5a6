"""The CLS's index of the workers' prefix caches: which worker holds which full KV block, by the
block's chained hash (engine/prefix_hash.py), kept from the deltas workers send with their reports.

Bounded: a worker keeps at most min(the blocks its prefix cache holds, its host tier's included,
`max_blocks` // workers in the index) entries, so the index never holds more than `max_blocks`; a
worker over its limit drops its least recent entries, on its own report or placement and, for every
worker, when one joins and the shares shrink.
Recency follows the engine's LRU: placing a request on a worker renews its prompt's chain there (the
worker will compute or receive those blocks, or hit them), the root most recent, as the engine
frees a sequence's tail first; a report adds what it newly cached behind that, a chain's tail
before its root, and leaves known entries where they are. So a chain loses its tail before its
root (a block whose parent is gone can never match).
Stale is safe: an entry for a block evicted since the last report (or one kept past a lost report)
only makes placement expect a hit the engine then misses; the engine matches content itself.
Each hash maps to a bit mask of its holders (a bit per worker), so a lookup intersects masks.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import islice

from splitserve.placement.state import PrefixDelta


@dataclass(slots=True)
class _Holder:
    bit: int  # its bit in the holder masks
    block_size: int
    num_blocks: int
    hashes: dict[int, None] = field(default_factory=dict)  # what it holds, least recent first


class PrefixIndex:
    def __init__(self, max_blocks: int):
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an integer >= 1, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._workers: dict[str, _Holder] = {}
        self._by_bit: dict[int, str] = {}  # bit -> worker id
        self._holders: dict[int, int] = {}  # hash -> mask of the workers holding it (never 0)

    @property
    def empty(self) -> bool:
        return not self._holders

    def num_entries(self, worker_id: str | None = None) -> int:
        """(worker, block) entries: of one worker, or of all."""
        if worker_id is not None:
            holder = self._workers.get(worker_id)
            return 0 if holder is None else len(holder.hashes)
        return sum(len(h.hashes) for h in self._workers.values())

    # ---- updates ---------------------------------------------------------------------------
    def apply(self, worker_id: str, delta: PrefixDelta) -> None:
        """A worker's report: a snapshot replaces what it held, a delta changes it; a worker not
        in the index joins it."""
        holder = self._workers.get(worker_id)
        if holder is None:
            holder = self._join(worker_id, delta)
        elif delta.snapshot:
            self._drop(holder, list(holder.hashes))
        holder.block_size, holder.num_blocks = delta.block_size, delta.num_blocks
        self._drop(holder, delta.removed)
        self._add(holder, delta.added, renew=False)
        self._trim(holder)

    def placed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """A request whose prompt's block chain is `hashes` was placed on the worker: it will hold
        those blocks (it computes or receives them, or hits them), so they become its most recent
        entries before its next report says so. A worker not yet in the index is a no-op."""
        holder = self._workers.get(worker_id)
        if holder is not None and hashes:
            self._add(holder, hashes, renew=True)
            self._trim(holder)

    def remove(self, worker_id: str) -> None:
        """A worker left (or was replaced: its successor has a new id); unknown ids are a no-op."""
        holder = self._workers.pop(worker_id, None)
        if holder is not None:
            self._drop(holder, list(holder.hashes))
            del self._by_bit[holder.bit]

    # ---- lookup ----------------------------------------------------------------------------
    def cached_tokens(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per worker holding at least the first of `hashes` (a prompt's block chain): the tokens
        of the leading blocks it holds."""
        holders, workers, by_bit = self._holders, self._workers, self._by_bit
        alive = holders.get(hashes[0], 0) if hashes else 0
        cached, depth = {}, 0
        while alive:
            depth += 1
            still = holders.get(hashes[depth], 0) & alive if depth < len(hashes) else 0
            ended = alive & ~still
            while ended:
                bit = ended & -ended
                worker_id = by_bit[bit]
                cached[worker_id] = depth * workers[worker_id].block_size
                ended ^= bit
            alive = still
        return cached

    # ---- internals -------------------------------------------------------------------------
    def _join(self, worker_id: str, delta: PrefixDelta) -> _Holder:
        used = sum(self._by_bit)
        bit = ~used & (used + 1)  # the lowest free bit
        holder = self._workers[worker_id] = _Holder(bit, delta.block_size, delta.num_blocks)
        self._by_bit[bit] = worker_id
        for other in self._workers.values():  # the shares shrank
            self._trim(other)
        return holder

    def _add(self, holder: _Holder, chain: Sequence[int], renew: bool) -> None:
        """Make `chain`'s new hashes (and, if `renew`, those already held) the worker's most recent
        entries, in reverse: its first (a root) is the most recent."""
        held, holders, bit = holder.hashes, self._holders, holder.bit
        for key_hash in reversed(chain):
            if key_hash not in held:
                holders[key_hash] = holders.get(key_hash, 0) | bit
            elif renew:
                del held[key_hash]  # re-inserted at the recent end
            else:
                continue
            held[key_hash] = None

    def _limit(self, holder: _Holder) -> int:
        return min(holder.num_blocks, self.max_blocks // len(self._workers))

    def _trim(self, holder: _Holder) -> None:
        excess = len(holder.hashes) - self._limit(holder)
        if excess > 0:
            self._drop(holder, list(islice(holder.hashes, excess)))

    def _drop(self, holder: _Holder, hashes: Sequence[int]) -> None:
        held, holders, keep = holder.hashes, self._holders, ~holder.bit
        for key_hash in hashes:
            if key_hash in held:
                del held[key_hash]
                mask = holders[key_hash] & keep
                if mask:
                    holders[key_hash] = mask
                else:
                    del holders[key_hash]

    def check_integrity(self, members: Collection[str]) -> None:
        """Raise RuntimeError if the holder masks and the workers' entries disagree, a bound fails,
        or a worker is not one of `members` (the cluster's)."""
        expected: dict[int, int] = {}
        for worker_id, holder in self._workers.items():
            if worker_id not in members:
                raise RuntimeError(f"prefix index: worker {worker_id!r} is not in the cluster")
            if self._by_bit.get(holder.bit) != worker_id:
                raise RuntimeError(f"prefix index: worker {worker_id!r} does not own its bit")
            if len(holder.hashes) > self._limit(holder):
                raise RuntimeError(f"prefix index: worker {worker_id!r} holds more entries than its limit")
            for key_hash in holder.hashes:
                expected[key_hash] = expected.get(key_hash, 0) | holder.bit
        if expected != self._holders or len(self._by_bit) != len(self._workers):
            raise RuntimeError("prefix index: the holder masks disagree with the workers' entries")
