"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and automatic prefix caching.

Pure Python (no torch): it hands out block ids; the KV cache tensors live in `KVCache`. The
simulator drives this same class.

Invariants (checked by `check_integrity`):
- a block's ref count equals the number of block tables that hold it; free blocks have ref 0;
- only full blocks whose KV is computed are hashed, and only hashed blocks are shared, so a
  shared block is never written (writes go to positions >= num_computed_tokens);
- a freed hashed block keeps its hash until it is reused for other content, so a later request
  with the same prefix can take it back (LRU: the oldest freed block is reused first).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from splitserve.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """The KV cache has too few free blocks for the request."""


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    key: tuple | None = None  # (parent key hash, token ids) for a hashed (full, computed) block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self._cached: dict[int, int] = {}         # hash(key) -> block id
        self._tables: dict[str, list[int]] = {}   # seq_id -> block ids
        self._chain: dict[str, tuple[int, int | None]] = {}  # seq_id -> (blocks hashed, hash of the last)
        self.num_cache_hit_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._blocks) - len(self._free)

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
        return self._free_blocks_needed(seq, self._prefix_hits(seq)) + reserve_blocks <= len(self._free)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._extra_blocks(seq.seq_id, num_tokens) <= len(self._free)

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix.

        Sets `seq.num_computed_tokens` to the tokens whose KV came from the cache.
        """
        if seq.seq_id in self._tables:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        hits = self._prefix_hits(seq) if use_prefix_cache else []
        if self._free_blocks_needed(seq, hits) > len(self._free):
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs more KV blocks than are free ({len(self._free)})")
        for block_id in hits:
            self._take(block_id)
        self._tables[seq.seq_id] = list(hits)
        self._chain[seq.seq_id] = (len(hits), hash(self._blocks[hits[-1]].key) if hits else None)
        self.num_cache_hit_blocks += len(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.grow(seq, seq.num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table hold at least `num_tokens` token slots."""
        extra = self._extra_blocks(seq.seq_id, num_tokens)
        if extra > len(self._free):
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs {extra} more KV blocks, {len(self._free)} free")
        table = self._tables[seq.seq_id]
        for _ in range(extra):
            table.append(self._take_fresh())

    def commit(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq.seq_id]
        done, parent = self._chain[seq.seq_id]
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        for i in range(done, full):
            key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block = self._blocks[table[i]]
            if block.key is None and hash(key) not in self._cached:  # else a duplicate: stays private
                block.key = key
                self._cached[hash(key)] = block.block_id
            parent = hash(key)  # the chain follows content, registered or not
        if full > done:
            self._chain[seq.seq_id] = (full, parent)

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks (tail first, so a prefix stays cached longest)."""
        for block_id in reversed(self._tables.pop(seq_id, [])):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        self._chain.pop(seq_id, None)

    def export_blocks(self, seq_id: str) -> list[int]:
        """The block ids holding a sequence's KV, in token order (for a KV transfer out)."""
        return list(self._tables[seq_id])

    def reserve_for_import(self, seq: Sequence) -> list[int]:
        """Fresh blocks for a sequence whose KV will be written by a transfer in."""
        self.allocate(seq, use_prefix_cache=False)
        seq.num_computed_tokens = 0
        return list(self._tables[seq.seq_id])

    # ---- internals -----------------------------------------------------------------------
    def _extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables[seq_id]))

    def _free_blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)  # cached but free
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never
        covered, so a step always computes at least one token and produces logits."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block_id = self._cached.get(hash(key))
            if block_id is None or self._blocks[block_id].key != key:
                break
            hits.append(block_id)
            parent = hash(key)
        return hits

    def _take_fresh(self) -> int:
        """The least recently freed block, its old cache entry dropped: it gets new content."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.key is not None:
            del self._cached[hash(block.key)]
            block.key = None
        block.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> int:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block_id

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the first broken invariant."""
        refs = [0] * len(self._blocks)
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise RuntimeError(f"block table of {seq_id!r} holds a block twice: {table}")
            for block_id in table:
                refs[block_id] += 1
        for block in self._blocks:
            if block.ref_count != refs[block.block_id]:
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count} but held by {refs[block.block_id]} tables")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count} disagrees with the free list")
            if block.ref_count > 1 and block.key is None:
                raise RuntimeError(f"block {block.block_id} is shared but not a cached full block")
        for h, block_id in self._cached.items():
            key = self._blocks[block_id].key
            if key is None or hash(key) != h:
                raise RuntimeError(f"prefix cache entry {h} points at block {block_id}, which holds other content")
