"""The prefix cache's second tier: hashed blocks the device cache evicts are kept in host memory
(`kv_host_cache_bytes`), and a later prefix hit copies them back instead of recomputing them.

Pure Python, like `BlockPool`, which drives it: the copies themselves are a `BlockMover`'s
(`host_kv_blocks` on a worker; the simulator's costs them).

Invariants (checked by `check`):
- a slot is free or holds one entry; an entry is cached under its group's key hash, and a content
  (group, key) is in at most one tier: a block restored to the device leaves the host tier, a
  block computed again on the device drops its host copy;
- entries are evicted least recently saved first; a restore copies a slot before anything else
  may reuse it (`restore` holds its slots while it takes blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol


class BlockMover(Protocol):
    def save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        """Copy device blocks into host slots, pairwise, before anything writes those blocks again."""

    def load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        """Copy host slots into device blocks, pairwise, before anything reads those blocks."""


@dataclass(frozen=True, slots=True)
class HostEntry:
    key: tuple  # prefix_hash.block_key of the block's content
    group: int  # the layer group whose KV it holds
    key_hash: int


class HostKVTier:
    def __init__(self, num_slots: int, groups: int, mover: BlockMover):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots, self.mover = num_slots, mover
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # slot -> entry, least recently saved first
        self.cached: list[dict[int, int]] = [{} for _ in range(groups)]  # per group: key hash -> slot
        self.saved_blocks = 0     # blocks copied to host memory so far
        self.restored_blocks = 0  # blocks copied back to the device so far
        self._taken: set[int] = set()  # slots a restore holds until it has copied them

    def lookup(self, group: int, key: tuple, key_hash: int) -> int | None:
        slot = self.cached[group].get(key_hash)
        return slot if slot is not None and self.entries[slot].key == key else None

    def keep(self, evicted: Seq[tuple[int, HostEntry]]) -> list[HostEntry]:
        """Save the device blocks `evicted` (block id, entry; oldest first) in place of the least
        recently saved entries; returns the entries neither tier holds now: those pushed out, and
        the oldest of `evicted` where more were evicted at once than the tier holds."""
        dropped = [entry for _, entry in evicted[:max(0, len(evicted) - self.num_slots + len(self._taken))]]
        evicted = evicted[len(dropped):]
        while len(self.free) < len(evicted):
            slot, entry = self.entries.popitem(last=False)
            del self.cached[entry.group][entry.key_hash]
            self.free.append(slot)
            dropped.append(entry)
        slots = [self.free.pop() for _ in evicted]
        for slot, (_, entry) in zip(slots, evicted):
            self.entries[slot] = entry
            self.cached[entry.group][entry.key_hash] = slot
        if slots:
            self.mover.save([block_id for block_id, _ in evicted], slots)
            self.saved_blocks += len(slots)
        return dropped

    def restore(self, entries: Seq[HostEntry], take_blocks: Callable[[int], list[int]]) -> list[int]:
        """Move `entries` back to the device: their slots are held (out of `keep`'s reach) while
        `take_blocks(n)` hands out the blocks, whose evictions `keep` saves, then copied into them
        and freed; returns the blocks, pairwise."""
        slots = []
        for entry in entries:
            slot = self.cached[entry.group].pop(entry.key_hash)
            del self.entries[slot]
            slots.append(slot)
        self._taken.update(slots)
        block_ids = take_blocks(len(slots))
        self.mover.load(slots, block_ids)
        self._taken.difference_update(slots)
        self.free.extend(slots)
        self.restored_blocks += len(slots)
        return block_ids

    def discard(self, group: int, key_hash: int) -> bool:
        """Drop an entry whose content the device computed again; whether there was one."""
        slot = self.cached[group].pop(key_hash, None)
        if slot is None:
            return False
        del self.entries[slot]
        self.free.append(slot)
        return True

    def check(self, device_cached: Seq[dict[int, int]]) -> None:
        """RuntimeError naming the first broken invariant (`device_cached`: the pool's per-group maps)."""
        if self._taken:
            raise RuntimeError(f"host KV slots {sorted(self._taken)} are held by a restore that never released them")
        if len(self.free) + len(self.entries) != self.num_slots or set(self.free) & self.entries.keys():
            raise RuntimeError("host KV slots are lost or both free and held")
        for group, cached in enumerate(self.cached):
            if sorted(cached.values()) != sorted(s for s, e in self.entries.items() if e.group == group):
                raise RuntimeError(f"the host KV tier's map of group {group} disagrees with its entries")
            if cached.keys() & device_cached[group].keys():
                raise RuntimeError(f"a block of group {group} is cached in both the device and the host tier")
