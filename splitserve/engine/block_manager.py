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
- a sequence's table list only grows (by appending) while the sequence holds it; a new allocation
  is a new list (the model runner's host mirror of the tables relies on this).
- a chain starts at `root_of(seq)`: where a model computes the same tokens' KV differently by
  sequence (LongRoPE's long prompts), those sequences chain from another root and share nothing
  with the rest.
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


class OutOfBlocksError(RuntimeError):
    """The KV cache has too few free blocks for the request."""


@dataclass(slots=True)
class _CachedBlock:
    key: tuple  # (parent key hash, token ids) of a hashed (full, computed) block: prefix_hash.block_key
    ref_count: int = 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 root_of: Callable[[Sequence], int] = lambda seq: ROOT):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root_of = root_of
        self._num_blocks = num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))  # free, no cached content; oldest freed first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free hashed blocks, LRU order
        self._hashed: dict[int, _CachedBlock] = {}  # block id -> its key and ref count
        self._cached: dict[int, int] = {}           # hash(key) -> block id
        self._tables: dict[str, list[int]] = {}     # seq_id -> block ids
        self._chain: dict[str, tuple[int, int]] = {}  # seq_id -> (blocks hashed, hash of the last or ROOT)
        self._newly_cached: dict[int, None] = {}  # prefix delta: hashes cached since the last take, in order
        self._evicted: set[int] = set()  # prefix delta: hashes evicted since the last take
        self.num_cache_hit_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def owners(self) -> list[str]:
        return list(self._tables)

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, reserve_blocks: int = 0) -> bool:
        """Whether `allocate(seq)` would succeed, leaving `reserve_blocks` free (a watermark)."""
        return self._free_blocks_needed(seq, self._prefix_hits(seq)) + reserve_blocks <= self.num_free_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._extra_blocks(seq.seq_id, num_tokens) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix.

        Sets `seq.num_computed_tokens` to the tokens whose KV came from the cache.
        """
        if seq.seq_id in self._tables:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        hits = self._prefix_hits(seq) if use_prefix_cache else []
        if self._free_blocks_needed(seq, hits) > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs more KV blocks than are free "
                                   f"({self.num_free_blocks})")
        for block_id in hits:
            self._take(block_id)
        self._tables[seq.seq_id] = list(hits)
        self._chain[seq.seq_id] = (len(hits), hash(self._hashed[hits[-1]].key) if hits else self._root_of(seq))
        self.num_cache_hit_blocks += len(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
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
        """Hash the full blocks whose KV is now computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
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

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks (tail first, so a prefix stays cached longest)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        done, _ = self._chain.pop(seq_id)
        self._fresh.extend(reversed(table[done:]))  # past the hashed prefix: unhashed, private
        for block_id in reversed(table[:done]):
            block = self._hashed.get(block_id)
            if block is None:
                self._fresh.append(block_id)  # a duplicate of cached content: private
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                self._evictable[block_id] = None

    def export_blocks(self, seq_id: str) -> list[int]:
        """The block ids holding a sequence's KV, in token order (for a KV transfer out)."""
        return list(self._tables[seq_id])

    def reserve_for_import(self, seq: Sequence, reuse_prefix: bool = False) -> list[int]:
        """Blocks for a sequence whose KV a transfer in writes. With `reuse_prefix`, cached full
        blocks of its prefix are shared (held, so never evicted meanwhile) and
        `seq.num_computed_tokens` is the number of leading tokens they hold: the transfer must write
        only the positions from there on (never the last token's, `_prefix_hits`). Without, every
        block is fresh and the transfer writes them all."""
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

    def _free_blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        revived = sum(1 for b in hits if self._hashed[b].ref_count == 0)  # cached but free
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never
        covered, so a step always computes at least one token and produces logits."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return []
        hits, parent = [], self._root_of(seq)
        for i in range(num_reusable_blocks(seq.num_tokens, self.block_size)):
            key = block_key(parent, seq.token_ids, i, self.block_size)
            parent = hash(key)
            block_id = self._cached.get(parent)
            if block_id is None or self._hashed[block_id].key != key:
                break
            hits.append(block_id)
        return hits

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
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise RuntimeError(f"block table of {seq_id!r} holds a block twice: {table}")
            done = self._chain[seq_id][0]
            if any(block_id in self._hashed for block_id in table[done:]):
                raise RuntimeError(f"block table of {seq_id!r} has a hashed block past its hashed prefix ({done})")
            for block_id in table:
                refs[block_id] += 1
        free = [*self._fresh, *self._evictable]
        if len(set(free)) != len(free):
            raise RuntimeError("a block is on the free lists twice")
        for block_id in free:
            if refs[block_id]:
                raise RuntimeError(f"block {block_id} is free but held by {refs[block_id]} tables")
        for block_id in self._fresh:
            if block_id in self._hashed:
                raise RuntimeError(f"block {block_id} is fresh but holds cached content")
        free_set = set(free)
        for block_id, count in enumerate(refs):
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
