"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and automatic prefix caching.

Pure Python (no torch): it hands out block ids; the KV cache tensors live in `KVCache`. The
simulator drives this same class.

Invariants (checked by `check_integrity`):
- only full blocks whose KV is computed are hashed, and only hashed blocks are shared, so a
  shared block is never written (writes go to positions >= num_computed_tokens); a hashed block's
  ref count equals the number of block tables that hold it, and an unhashed block is held by at
  most one table;
- every block is held by a table or free, never both. Free blocks are fresh (no cached content)
  or evictable (hashed, ref count 0): a freed hashed block keeps its hash until it is reused for
  other content, so a later request with the same prefix can take it back. Fresh blocks are reused
  first, oldest freed first; then evictable ones, least recently freed first (LRU).
- the blocks of a table past its hashed prefix (`_chain`) are unhashed, so freeing a table that
  was never hashed touches no block one by one.
- the prefix delta (what the cluster-level scheduler is told next) is net: hashes cached since the
  last take are all still cached, hashes evicted since are none of them. Only caching and eviction
  record it, so with prefix caching off it costs nothing.
- a sequence's table list only grows (by appending) while the sequence holds it, but for released
  entries (below); a new allocation is a new list (the model runner's host mirror of the tables
  relies on this: it keeps a released entry's old id, masked out of every query's window).
- a chain starts at `root_of(seq)`: where a model computes the same tokens' KV differently by
  sequence (LongRoPE's long prompts), those sequences chain from another root and share nothing
  with the rest.

With a `window` (a model whose every layer attends to the latest `window` positions), a table's
leading blocks that no later query can reach are released as the sequence advances: their entries
become NULL_BLOCK, an id never handed out, so a table holds about a window's blocks however long
its sequence grows. Released entries lead the table (`_released` of them) and are the only
NULL_BLOCKs in it; entries only change in place from an id to NULL_BLOCK. A prefix hit then
needs only the cached blocks within the window of its end. A sequence that is handed off
(exported to a token worker) holds every block, released none and took its hit whole: the
export reads them all, and the importer caches what it receives.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.prefix_hash import ROOT, block_key, chain_root, num_reusable_blocks
from splitserve.engine.sequence import Sequence


def long_rope_root(long_from: int | None) -> Callable[[Sequence], int]:
    """`root_of` for a model: with LongRoPE, a sequence of more than `long_from` tokens (whose KV
    turns long) chains from LONG_ROPE_ROOT (`prefix_hash.chain_root`, as the ingress names it)."""
    return lambda seq: chain_root(seq.num_tokens, long_from)


NULL_BLOCK = 0  # with a window: the reserved id that stands in a table for a released block


class OutOfBlocksError(RuntimeError):
    """The KV cache has too few free blocks for the request."""


@dataclass(slots=True)
class _CachedBlock:
    key: tuple  # (parent key hash, token ids) of a hashed (full, computed) block: prefix_hash.block_key
    ref_count: int = 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 root_of: Callable[[Sequence], int] = lambda seq: ROOT, window: int | None = None):
        """`num_blocks`: the cache's blocks; with a `window`, one of them is NULL_BLOCK."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if window is not None and (window < 1 or num_blocks < 2):
            raise ValueError(f"a window needs window >= 1 and num_blocks >= 2, got {window}, {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self._root_of = root_of
        self._num_blocks = num_blocks
        self._reserved = int(window is not None)  # NULL_BLOCK's one, or none
        # free, no cached content; oldest freed first
        self._fresh: deque[int] = deque(range(self._reserved, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free hashed blocks, LRU order
        self._hashed: dict[int, _CachedBlock] = {}  # block id -> its key and ref count
        self._cached: dict[int, int] = {}           # hash(key) -> block id
        self._tables: dict[str, list[int]] = {}     # seq_id -> block ids
        self._chain: dict[str, tuple[int, int]] = {}  # seq_id -> (blocks hashed, hash of the last or ROOT)
        self._released: dict[str, int] = {}  # seq_id -> its table's leading NULL_BLOCKs (with a window)
        self._newly_cached: dict[int, None] = {}  # prefix delta: hashes cached since the last take, in order
        self._evicted: set[int] = set()  # prefix delta: hashes evicted since the last take
        self.num_cache_hit_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """The blocks sequences can hold."""
        return self._num_blocks - self._reserved

    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def num_held_blocks(self, seq_id: str) -> int:
        """The blocks a sequence holds (its table's entries but the released ones)."""
        return len(self._tables[seq_id]) - self._released.get(seq_id, 0)

    def owners(self) -> list[str]:
        return list(self._tables)

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, reserve_blocks: int = 0) -> bool:
        """Whether `allocate(seq)` would succeed, leaving `reserve_blocks` free (a watermark)."""
        released, hits, _ = self._prefix_hits(seq)
        return self._free_blocks_needed(seq, released, hits) + reserve_blocks <= self.num_free_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._extra_blocks(seq.seq_id, num_tokens) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix.

        Sets `seq.num_computed_tokens` to the tokens whose KV came from the cache.
        """
        if seq.seq_id in self._tables:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        released, hits, parent = self._prefix_hits(seq) if use_prefix_cache else (0, [], self._root_of(seq))
        if self._free_blocks_needed(seq, released, hits) > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs more KV blocks than are free "
                                   f"({self.num_free_blocks})")
        for block_id in hits:
            self._take(block_id)
        cached = released + len(hits)
        self._tables[seq.seq_id] = [NULL_BLOCK] * released + hits
        self._chain[seq.seq_id] = (cached, parent)
        if self.window is not None:
            self._released[seq.seq_id] = released
        self.num_cache_hit_blocks += cached
        seq.num_cached_tokens = seq.num_computed_tokens = cached * self.block_size
        self.grow(seq, seq.num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table hold at least `num_tokens` token slots."""
        if not self.try_grow(seq, num_tokens):
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs {self._extra_blocks(seq.seq_id, num_tokens)} "
                                   f"more KV blocks, {self.num_free_blocks} free")

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """`grow` if the free blocks allow it (True), else change nothing (False)."""
        table = self._tables[seq.seq_id]
        extra = -(-num_tokens // self.block_size) - len(table)
        if extra <= 0:
            return True
        if extra > len(self._fresh) + len(self._evictable):
            return False
        table += self._take_fresh(extra)
        return True

    def commit(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed, so later requests can share them; with a
        window, then release the blocks wholly before the window of the next query (at position
        num_computed_tokens or later), unless the sequence is handed off."""
        if self.enable_prefix_caching:
            self._hash_computed(seq)
        if self.window is not None and not seq.hand_off:
            self._release_out_of_window(seq)

    def _hash_computed(self, seq: Sequence) -> None:
        table = self._tables[seq.seq_id]
        done, parent = self._chain[seq.seq_id]
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        for i in range(done, full):
            key = block_key(parent, seq.token_ids, i, self.block_size)
            key_hash = hash(key)
            if key_hash not in self._cached:  # else a duplicate: stays private (unhashed)
                self._hashed[table[i]] = _CachedBlock(key)
                self._cached[key_hash] = table[i]
                if key_hash in self._evicted:
                    self._evicted.discard(key_hash)
                else:
                    self._newly_cached[key_hash] = None
            parent = key_hash  # the chain follows content, registered or not
        if full > done:
            self._chain[seq.seq_id] = (full, parent)

    def _release_out_of_window(self, seq: Sequence) -> None:
        """A query at p >= num_computed_tokens reads positions > p - window: the blocks that end at
        or before num_computed_tokens - window + 1 are never read again. Hashing comes first, so a
        released block that was cached stays cached (evictable) for later prefix hits."""
        table, released = self._tables[seq.seq_id], self._released[seq.seq_id]
        reach = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        for i in range(released, reach):
            self._drop(table[i])
            table[i] = NULL_BLOCK
        if reach > released:
            self._released[seq.seq_id] = reach

    def _drop(self, block_id: int) -> None:
        """One table lets `block_id` go: a private block is fresh again, a cached one evictable
        once no table holds it."""
        block = self._hashed.get(block_id)
        if block is None:
            self._fresh.append(block_id)
            return
        block.ref_count -= 1
        if block.ref_count == 0:
            self._evictable[block_id] = None

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks (tail first, so a prefix stays cached longest)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        done, _ = self._chain.pop(seq_id)
        released = self._released.pop(seq_id, 0)
        self._fresh.extend(reversed(table[max(done, released):]))  # past the hashed prefix: unhashed, private
        for block_id in reversed(table[released:done]):
            self._drop(block_id)  # unhashed where it duplicates cached content

    def export_blocks(self, seq_id: str) -> list[int]:
        """The block ids holding a sequence's KV, in token order (for a KV transfer out: a
        handed-off sequence, which holds them all)."""
        return list(self._tables[seq_id])

    def reserve_for_import(self, seq: Sequence, reuse_prefix: bool = False) -> list[int]:
        """Blocks for a sequence whose KV a transfer in writes. With `reuse_prefix`, cached full
        blocks of its prefix are shared (held, so never evicted meanwhile) and
        `seq.num_computed_tokens` is the number of leading tokens they hold (with a window, the
        leading ones out of its reach are NULL_BLOCK): the transfer must write only the positions
        from there on (never the last token's, `_prefix_hits`). Without, every block is fresh and
        the transfer writes them all."""
        self.allocate(seq, use_prefix_cache=reuse_prefix)
        return list(self._tables[seq.seq_id])

    def take_prefix_delta(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prefix cache's net change since the last take (or snapshot): the hashes cached,
        oldest first, and the hashes evicted."""
        delta = tuple(self._newly_cached), tuple(self._evicted)
        self._newly_cached, self._evicted = {}, set()
        return delta

    def take_prefix_snapshot(self) -> tuple[int, ...]:
        """Every hash cached now, oldest first; the next delta counts from here."""
        self._newly_cached, self._evicted = {}, set()
        return tuple(self._cached)

    # ---- internals -----------------------------------------------------------------------
    def _extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables[seq_id]))

    def _free_blocks_needed(self, seq: Sequence, released: int, hits: list[int]) -> int:
        revived = sum(1 for b in hits if self._hashed[b].ref_count == 0)  # cached but free
        return self.blocks_for(seq.num_tokens) - released - len(hits) + revived

    def _prefix_hits(self, seq: Sequence) -> tuple[int, list[int], int]:
        """(released, hits, parent): the sequence's first released + len(hits) blocks come from the
        cache; `hits` are the cached blocks holding the last len(hits) of them, the first
        `released` are not needed (out of the window's reach: none without a window), `parent` the
        hash the chain goes on from. The last token is never covered, so a step always computes at
        least one token and produces logits."""
        root, window = self._root_of(seq), None if seq.hand_off else self.window
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return 0, [], root
        found, parents, parent = [], [], root
        for i in range(num_reusable_blocks(seq.num_tokens, self.block_size)):
            key = block_key(parent, seq.token_ids, i, self.block_size)
            parent = hash(key)
            block_id = self._cached.get(parent)
            if block_id is None or self._hashed[block_id].key != key:
                if window is None:
                    break
                block_id = None  # a gap: a later hit needs a window that starts past it
            found.append(block_id)
            parents.append(parent)
        best, gap = 0, -1  # the longest prefix whose needed blocks are all cached; the last miss so far
        for i, block_id in enumerate(found):
            if block_id is None:
                gap = i
            if self._first_needed(i + 1, window) > gap:
                best = i + 1
        first = self._first_needed(best, window)
        return first, found[first:best], parents[best - 1] if best else root

    def _first_needed(self, blocks: int, window: int | None) -> int:
        """The first block a query right after `blocks` computed blocks can read."""
        if window is None:
            return 0
        return max(0, blocks * self.block_size - window + 1) // self.block_size

    def _take_fresh(self, count: int) -> list[int]:
        """`count` free blocks for new content: fresh ones first, then evicted ones (their cache
        entries dropped). The caller has checked that enough are free."""
        fresh = self._fresh
        if count <= len(fresh):
            popleft = fresh.popleft
            return [popleft() for _ in range(count)]
        taken = list(fresh)
        fresh.clear()
        for _ in range(count - len(taken)):
            block_id, _ = self._evictable.popitem(last=False)
            key_hash = hash(self._hashed.pop(block_id).key)
            del self._cached[key_hash]
            if key_hash in self._newly_cached:  # cached and evicted since the last take: no change
                del self._newly_cached[key_hash]
            else:
                self._evicted.add(key_hash)
            taken.append(block_id)
        return taken

    def _take(self, block_id: int) -> None:
        """Share the cached block `block_id` (reviving it if it was free)."""
        block = self._hashed[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the first broken invariant."""
        refs = [0] * self._num_blocks
        for seq_id, whole in self._tables.items():
            released = self._released.get(seq_id, 0)
            table = whole[released:]
            if any(block_id != NULL_BLOCK for block_id in whole[:released]) or \
                    (self._reserved and NULL_BLOCK in table):
                raise RuntimeError(f"block table of {seq_id!r} is not {released} released entries, then held blocks")
            if len(set(table)) != len(table):
                raise RuntimeError(f"block table of {seq_id!r} holds a block twice: {whole}")
            done = self._chain[seq_id][0]
            if any(block_id in self._hashed for block_id in whole[max(done, released):]):
                raise RuntimeError(f"block table of {seq_id!r} has a hashed block past its hashed prefix ({done})")
            for block_id in table:
                refs[block_id] += 1
        free = [*self._fresh, *self._evictable]
        free_set = set(free)
        if len(free_set) != len(free):
            raise RuntimeError("a block is on the free lists twice")
        for block_id in free:
            if refs[block_id]:
                raise RuntimeError(f"block {block_id} is free but held by {refs[block_id]} tables")
        for block_id in self._fresh:
            if block_id in self._hashed:
                raise RuntimeError(f"block {block_id} is fresh but holds cached content")
        if self._reserved and (NULL_BLOCK in free_set or NULL_BLOCK in self._hashed):
            raise RuntimeError("NULL_BLOCK is on the free lists or cached")
        for block_id, count in enumerate(refs[self._reserved:], self._reserved):
            block = self._hashed.get(block_id)
            if block is not None and block.ref_count != count:
                raise RuntimeError(f"block {block_id}: ref_count {block.ref_count} but held by {count} tables")
            if block is None and count > 1:
                raise RuntimeError(f"block {block_id} is shared but not a cached full block")
            if (count == 0) != (block_id in free_set):
                raise RuntimeError(f"block {block_id}: held by {count} tables, which disagrees with the free lists")
        for block_id in self._evictable:
            if block_id not in self._hashed:
                raise RuntimeError(f"block {block_id} is evictable but holds no cached content")
        for h, block_id in self._cached.items():
            block = self._hashed.get(block_id)
            if block is None or hash(block.key) != h:
                raise RuntimeError(f"prefix cache entry {h} points at block {block_id}, which holds other content")
        if not self._newly_cached.keys() <= self._cached.keys() or not self._evicted.isdisjoint(self._cached):
            raise RuntimeError("the prefix delta disagrees with the prefix cache")
