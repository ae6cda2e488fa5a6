"""The prefix cache's second tier: hashed blocks the device cache evicts are kept in host memory
(`kv_host_cache_bytes`), and a later prefix hit copies them back instead of recomputing them.

Two write policies (`kv_host_write_policy`, SGLang's names):
- write-back: a block is copied out when the device evicts it, in the step that evicts it, and a
  content (group, key) is in at most one tier: a block restored to the device leaves the host
  tier, a block computed again on the device drops its host copy;
- write-through: a block is copied out once its KV is computed and cached (`on_cached`, issued by
  `flush`: on CUDA on a side stream, overlapping the next forward), so an eviction copies nothing;
  the host tier holds its own LRU window of what was computed, whether or not the device still
  does. A `fence` orders the device after every write issued before a written block is reused
  or a slot read back.

Pure Python, like `BlockPool`, which drives it: the copies themselves are a `BlockMover`'s
(`host_kv_blocks` on a worker; the simulator's costs them).

Invariants (checked by `check`):
- a slot is free or holds one entry; an entry is cached under its group's key hash; a write not
  yet issued is an entry's;
- entries are evicted least recently saved, written or evicted from the device first; a restore
  copies a slot before anything else may reuse it (`restore` holds its slots while it takes blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol


class BlockMover(Protocol):
    def save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        """Copy device blocks into host slots, pairwise, before anything writes those blocks again."""

    def write(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        """As `save`, after every forward so far but not ordering the ones after it (`fence` does)."""

    def fence(self) -> None:
        """Order what the device does next after every `write` so far."""

    def load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        """Copy host slots into device blocks, pairwise, before anything reads those blocks."""


@dataclass(frozen=True, slots=True)
class HostEntry:
    key: tuple  # prefix_hash.block_key of the block's content
    group: int  # the layer group whose KV it holds
    key_hash: int


class HostKVTier:
    def __init__(self, num_slots: int, groups: int, mover: BlockMover, write_through: bool = False):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots, self.mover, self.write_through = num_slots, mover, write_through
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # slot -> entry, least recently used first
        self.cached: list[dict[int, int]] = [{} for _ in range(groups)]  # per group: key hash -> slot
        self.saved_blocks = 0     # blocks copied to host memory so far
        self.restored_blocks = 0  # blocks copied back to the device so far
        self._taken: set[int] = set()  # slots a restore holds until it has copied them
        self._unwritten: dict[int, int] = {}  # write-through: slot -> device block, for the next flush
        self._unfenced = False  # a write was issued since the last fence

    def lookup(self, group: int, key: tuple, key_hash: int) -> int | None:
        slot = self.cached[group].get(key_hash)
        return slot if slot is not None and self.entries[slot].key == key else None

    def on_cached(self, block_id: int, entry: HostEntry) -> tuple[bool, list[HostEntry]]:
        """The device just cached block `block_id` as `entry`: whether the tier held that content
        (write-back drops its copy, the device's is the one now), and the entries pushed out to
        make room (write-through keeps a copy of a new content, copied at the next `flush`)."""
        slot = self.lookup(entry.group, entry.key, entry.key_hash)
        if slot is not None:
            if not self.write_through:
                del self.cached[entry.group][entry.key_hash], self.entries[slot]
                self.free.append(slot)
            return True, []
        if not self.write_through:
            return False, []
        dropped = self._make_room(1)
        slot = self.free.pop()
        self._add(slot, entry)
        self._unwritten[slot] = block_id
        return False, dropped

    def flush(self) -> None:
        """Issue the copies `write` queued, as one."""
        if self._unwritten:
            self.mover.write(list(self._unwritten.values()), list(self._unwritten))
            self.saved_blocks += len(self._unwritten)
            self._unwritten.clear()
            self._unfenced = True

    def keep(self, evicted: Seq[tuple[int, HostEntry]]) -> list[HostEntry]:
        """Keep the device blocks `evicted` (block id, entry; oldest first): one the tier has a copy
        of (written through) becomes its most recently used, its write fenced before the block is
        reused; the others are saved in place of the least recently used entries. Returns the
        entries pushed out, and the oldest of `evicted` where more were evicted at once than the
        tier holds (the pool keeps those the device still caches)."""
        self.flush()
        if evicted:
            self._fence()  # the evicted blocks are written before reuse, a slot before a save replaces it
        unsaved = []
        for block_id, entry in evicted:
            slot = self.lookup(entry.group, entry.key, entry.key_hash) if self.write_through else None
            if slot is None:
                unsaved.append((block_id, entry))
            else:
                self.entries.move_to_end(slot)
        dropped = [entry for _, entry in unsaved[:max(0, len(unsaved) - self.num_slots + len(self._taken))]]
        unsaved = unsaved[len(dropped):]
        dropped += self._make_room(len(unsaved))
        slots = [self.free.pop() for _ in unsaved]
        for slot, (_, entry) in zip(slots, unsaved):
            self._add(slot, entry)
        if slots:
            self.mover.save([block_id for block_id, _ in unsaved], slots)
            self.saved_blocks += len(slots)
        return dropped

    def restore(self, entries: Seq[HostEntry], take_blocks: Callable[[int], list[int]]) -> list[int]:
        """Copy `entries` back to the device: their slots are held (out of `keep`'s reach) while
        `take_blocks(n)` hands out the blocks, whose evictions `keep` saves, then copied into them;
        write-back frees the slots (the device holds the blocks now), write-through keeps them as
        the most recently used; returns the blocks, pairwise. (A slot written through was fenced
        when the device evicted its content, before any restore could want it.)"""
        slots = []
        for entry in entries:
            slot = self.cached[entry.group].pop(entry.key_hash)
            del self.entries[slot]
            slots.append(slot)
        self._taken.update(slots)
        block_ids = take_blocks(len(slots))
        self.mover.load(slots, block_ids)
        self._taken.difference_update(slots)
        for slot, entry in zip(slots, entries):
            if self.write_through:
                self._add(slot, entry)
            else:
                self.free.append(slot)
        self.restored_blocks += len(slots)
        return block_ids

    def _make_room(self, count: int) -> list[HostEntry]:
        """At least `count` free slots, pushing out the least recently used entries; those entries."""
        dropped = []
        while len(self.free) < count:
            slot, entry = self.entries.popitem(last=False)
            del self.cached[entry.group][entry.key_hash]
            self._unwritten.pop(slot, None)
            self.free.append(slot)
            dropped.append(entry)
        return dropped

    def _add(self, slot: int, entry: HostEntry) -> None:
        self.entries[slot] = entry
        self.cached[entry.group][entry.key_hash] = slot

    def _fence(self) -> None:
        if self._unfenced:
            self.mover.fence()
            self._unfenced = False

    def check(self, device_cached: Seq[dict[int, int]]) -> None:
        """RuntimeError naming the first broken invariant (`device_cached`: the pool's per-group maps)."""
        if self._taken:
            raise RuntimeError(f"host KV slots {sorted(self._taken)} are held by a restore that never released them")
        if len(self.free) + len(self.entries) != self.num_slots or set(self.free) & self.entries.keys():
            raise RuntimeError("host KV slots are lost or both free and held")
        if not self._unwritten.keys() <= self.entries.keys():
            raise RuntimeError("a write-through copy is queued for a slot no entry holds")
        for group, cached in enumerate(self.cached):
            if sorted(cached.values()) != sorted(s for s, e in self.entries.items() if e.group == group):
                raise RuntimeError(f"the host KV tier's map of group {group} disagrees with its entries")
            if not self.write_through and cached.keys() & device_cached[group].keys():
                raise RuntimeError(f"a block of group {group} is cached in both the device and the host tier")
