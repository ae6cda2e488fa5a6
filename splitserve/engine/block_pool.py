"""The KV cache's blocks as a pool: free lists and the prefix cache, shared by every layer group's
block tables (`BlockManager` keeps the tables).

Invariants (checked by `BlockManager.check_integrity`):
- a block is free or held, never both. Free blocks are fresh (no cached content) or evictable
  (hashed, ref count 0): a freed hashed block keeps its hash until it is reused for other
  content, so a later request with the same prefix can take it back. Fresh blocks are reused
  first, oldest freed first; then evictable ones, least recently freed first (LRU).
- a hashed block holds the KV of one layer group (its `group`) and is cached under its key in
  that group's cache only: groups hold different layers, so the same tokens' blocks differ.
- the prefix delta (what the cluster-level scheduler is told next) is group 0's and net: hashes
  cached since the last take are all still cached, hashes evicted since are none of them. Only
  caching and eviction record it, so with prefix caching off it costs nothing.
- the first `reserved` ids (NULL_BLOCK, where a group has a window) are never handed out.
- with a host tier (`host_kv_tier`), an evicted hashed block is saved there (write-back) or was
  written there when it was cached (write-through) before its id is handed out again, and the
  prefix delta counts the two tiers as one cache: a block moving between them records nothing, one
  the host tier pushes out is evicted unless the device still caches it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from splitserve.engine.host_kv_tier import HostEntry, HostKVTier

NULL_BLOCK = 0  # with a windowed group: the reserved id that stands in a table for a released block


@dataclass(slots=True)
class CachedBlock:
    key: tuple  # (parent key hash, token ids) of a hashed (full, computed) block: prefix_hash.block_key
    group: int  # the layer group whose KV it holds
    ref_count: int = 1


class BlockPool:
    def __init__(self, num_blocks: int, reserved: int, groups: int, host_tier: HostKVTier | None = None):
        self.num_blocks, self.reserved, self.host_tier = num_blocks, reserved, host_tier
        self.fresh: deque[int] = deque(range(reserved, num_blocks))  # free, no cached content; oldest freed first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free hashed blocks, LRU order
        self.hashed: dict[int, CachedBlock] = {}  # block id -> its key, group and ref count
        self.cached: list[dict[int, int]] = [{} for _ in range(groups)]  # per group: hash(key) -> block id
        self._newly_cached: dict[int, None] = {}  # prefix delta: hashes cached since the last take, in order
        self._evicted: set[int] = set()  # prefix delta: hashes evicted since the last take

    @property
    def num_free(self) -> int:
        return len(self.fresh) + len(self.evictable)

    def lookup(self, group: int, key: tuple, key_hash: int) -> int | None:
        """The cached block of `group` holding `key`'s KV, or None."""
        block_id = self.cached[group].get(key_hash)
        return block_id if block_id is not None and self.hashed[block_id].key == key else None

    def register(self, group: int, block_id: int, key: tuple, key_hash: int) -> bool:
        """Cache a held block under `key`, unless the group caches that content already (then it
        stays private); whether it was cached."""
        cached = self.cached[group]
        if key_hash in cached:
            return False
        self.hashed[block_id] = CachedBlock(key, group)
        cached[key_hash] = block_id
        held = False  # a host copy: cached all along
        if self.host_tier is not None:
            held, dropped = self.host_tier.on_cached(block_id, HostEntry(key, group, key_hash))
            self._record_evicted(self._uncached(dropped))
        if group or held:
            return True
        if key_hash in self._evicted:
            self._evicted.discard(key_hash)
        else:
            self._newly_cached[key_hash] = None
        return True

    def take_fresh(self, count: int) -> list[int]:
        """`count` free blocks for new content: fresh ones first, then evicted ones (their cache
        entries dropped). The caller has checked that enough are free."""
        fresh = self.fresh
        if count <= len(fresh):
            popleft = fresh.popleft
            return [popleft() for _ in range(count)]
        taken = list(fresh)
        fresh.clear()
        evicted = []
        for _ in range(count - len(taken)):
            block_id, _ = self.evictable.popitem(last=False)
            block = self.hashed.pop(block_id)
            key_hash = hash(block.key)
            del self.cached[block.group][key_hash]
            evicted.append((block_id, HostEntry(block.key, block.group, key_hash)))
            taken.append(block_id)
        self._record_evicted(self._uncached(self.host_tier.keep(evicted)) if self.host_tier is not None else
                             [entry for _, entry in evicted])
        return taken

    def _uncached(self, entries: Seq[HostEntry]) -> list[HostEntry]:
        """Those of `entries` (the host tier pushed out) the device does not cache."""
        return [entry for entry in entries if self.lookup(entry.group, entry.key, entry.key_hash) is None]

    def _record_evicted(self, entries: Seq[HostEntry]) -> None:
        for entry in entries:
            if entry.group:
                continue
            if entry.key_hash in self._newly_cached:  # cached and evicted since the last take: no change
                del self._newly_cached[entry.key_hash]
            else:
                self._evicted.add(entry.key_hash)

    def revive(self, block_id: int, entry: HostEntry) -> None:
        """Cache a block taken fresh whose content a restore has copied in, free (evictable) and
        most recently used; cached all along, for the prefix delta."""
        self.hashed[block_id] = CachedBlock(entry.key, entry.group, ref_count=0)
        self.cached[entry.group][entry.key_hash] = block_id
        self.evictable[block_id] = None

    def take(self, block_id: int) -> None:
        """Share the cached block `block_id` (reviving it if it was free)."""
        block = self.hashed[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def drop(self, block_id: int) -> None:
        """One table lets `block_id` go: a private block is fresh again, a cached one evictable
        once no table holds it."""
        block = self.hashed.get(block_id)
        if block is None:
            self.fresh.append(block_id)
            return
        block.ref_count -= 1
        if block.ref_count == 0:
            self.evictable[block_id] = None

    def take_delta(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        delta = tuple(self._newly_cached), tuple(self._evicted)
        self._newly_cached, self._evicted = {}, set()
        return delta

    def take_snapshot(self) -> tuple[int, ...]:
        self._newly_cached, self._evicted = {}, set()
        return tuple(self._cached_anywhere())

    def _cached_anywhere(self) -> dict[int, int]:
        """Group 0's hashes in either tier, the host tier's (older) first."""
        return self.cached[0] if self.host_tier is None else {**self.host_tier.cached[0], **self.cached[0]}

    def check_delta(self) -> None:
        cached = self._cached_anywhere()
        if not self._newly_cached.keys() <= cached.keys() or not self._evicted.isdisjoint(cached):
            raise RuntimeError("the prefix delta disagrees with the prefix cache")
        if self.host_tier is not None:
            self.host_tier.check(self.cached)
