"""Paged KV-cache bookkeeping: block tables per sequence and layer group, over one `BlockPool`
(free lists and automatic prefix caching).

Pure Python (no torch): it hands out block ids; the KV cache tensors live in `KVCache`. The
simulator drives this same class.

Layer groups: a model whose layers all attend alike has one group. Where some layers slide and
others attend to the whole context (Gemma 2 and 3, GPT-OSS), the layers are split into groups of
one kind each (`engine.kv_groups`); a sequence has a table per group, all drawing on one pool, so
a windowed group's tables hold about a window's blocks while the full groups' grow with the
context. Every table of a sequence covers the same tokens.

Invariants (checked by `check_integrity`, with the pool's):
- only full blocks whose KV is computed are hashed, and only hashed blocks are shared, so a
  shared block is never written (writes go to positions >= num_computed_tokens); a hashed block's
  ref count equals the number of block tables that hold it, all of its group, and an unhashed
  block is held by at most one table;
- every block is held by a table or free, never both;
- the blocks of a table past its hashed prefix (`HeldBlocks.done`) are unhashed, so freeing a table
  that was never hashed touches no block one by one;
- a sequence's table lists only grow (by appending) while the sequence holds them, but for
  released entries (below); a new allocation is new lists (the model runner's host mirror of the
  tables relies on this: it keeps a released entry's old id, masked out of every query's window);
- a chain starts at `root_of(seq)`: where a model computes the same tokens' KV differently by
  sequence (LongRoPE's long prompts, a LoRA adapter's: `prefix_hash.sequence_root`), those
  sequences chain from another root and share nothing with the rest.

A windowed group (its layers attend to the latest `window` positions) releases the leading blocks
of a table that no later query can reach as the sequence advances: their entries become
NULL_BLOCK, an id never handed out. Released entries lead the table and are the only NULL_BLOCKs
in it; entries only change in place from an id to NULL_BLOCK. A prefix hit needs every group's
cached blocks within that group's reach from the hit's end: all of them for a full group, a
window's for a windowed one. A sequence that is handed off (exported to a token worker) takes its
hit whole and keeps every block its export reads (`Sequence.export_from`: the token worker's
reach; all without it), releasing only those before both that and its own reach. The importer's
windowed tables reserve only what its first decode reaches (`reserve_for_import`): their leading
entries are NULL_BLOCK from the start, and it caches the blocks it holds.

A prompt of a model with a windowed group that is prefilled in chunks (`allocate(chunk_tokens=C)`)
takes its blocks chunk by chunk (`grow` before each) rather than all at admission: a windowed
table then never holds more than a window and a chunk's blocks, where a prompt taken whole would
hold all of them until the step that computes them. Admission still guarantees the rest of its
prefill: blocks are *promised* to it (`block_promises`), counted out of `num_free_blocks`, and
its `grow`s draw on them first; so its chunks find their blocks as a whole prompt's do (but for
the rare case `BlockPromises.settle` names).

With a host tier (`host_kv_tier`), the pool saves the cached blocks it evicts in host memory, and
`allocate` and `reserve_for_import` first copy back those of the sequence's prefix
(`prefix_restore`); the queries never copy, and ask of the free blocks what the copies leave.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence as Seq

from splitserve.engine.block_integrity import check_tables
from splitserve.engine.block_pool import NULL_BLOCK, BlockPool
from splitserve.engine.block_promises import BlockPromises
from splitserve.engine.held_blocks import HeldBlocks
from splitserve.engine.host_kv_tier import HostKVTier
from splitserve.engine.prefix_hash import ROOT, block_key
from splitserve.engine.prefix_hit import PrefixHit, find_hit, first_needed, handed_off_hit, no_hit, released_to
from splitserve.engine.prefix_restore import restored_hit
from splitserve.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """The KV cache has too few free blocks for the request."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 root_of: Callable[[Sequence], int] = lambda seq: ROOT, windows: Seq[int | None] = (None,),
                 host_tier: HostKVTier | None = None):
        """`num_blocks`: the cache's blocks; where a group has a window, one of them is NULL_BLOCK.
        `windows`: per layer group, its window or None (whole context). `host_tier`: where evicted
        cached blocks are kept (None: they are dropped)."""
        windows = tuple(windows)
        reserved = int(any(w is not None for w in windows))
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows) or num_blocks <= reserved:
            raise ValueError(f"windows must be one per layer group, each None or >= 1, and a window needs "
                             f"num_blocks >= 2, got {windows}, {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self._root_of = root_of
        self._pool = BlockPool(num_blocks, reserved, len(windows), host_tier)
        self._held: dict[str, HeldBlocks] = {}
        self._promises = BlockPromises(self._pool, windows, block_size)
        self.num_cache_hit_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        """The blocks sequences can hold."""
        return self._pool.num_blocks - self._pool.reserved

    @property
    def num_cacheable_blocks(self) -> int:
        """The blocks the prefix cache can hold at once: the cache's, and the host tier's slots."""
        tier = self._pool.host_tier
        return self.num_blocks + (tier.num_slots if tier is not None else 0)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks not promised to a prompt being prefilled chunk by chunk."""
        return self._pool.num_free - self._promises.total

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        """Group 0's table (the only one of a model with one group)."""
        return self._held[seq_id].tables[0]

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """Every group's table."""
        return self._held[seq_id].tables

    def held_from(self, seq: Sequence) -> tuple[int, ...]:
        """Per group: the first position past the sequence's computed tokens whose block its table
        holds (a windowed group's released entries lead it), at most its last token's. An import
        receives each group's KV from there on."""
        first, last = seq.num_computed_tokens, seq.num_tokens - 1
        return tuple(min(last, max(first, released * self.block_size)) for released in self._held[seq.seq_id].released)

    def num_held_blocks(self, seq_id: str) -> int:
        """The blocks a sequence holds (its tables' entries but the released ones) or is promised."""
        held = self._held[seq_id]
        return self._count(held) + held.promised

    def owners(self) -> list[str]:
        return list(self._held)

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._held

    @property
    def window_tokens(self) -> int:
        """The most token slots a windowed group's table of a decoding sequence holds: from the
        block its next query reaches back to through the one it writes (0: no windowed group)."""
        return max(((self.blocks_for(w - 1) + 1) * self.block_size for w in self.windows if w is not None), default=0)

    def full_growth(self, seq: Sequence) -> int:
        """The blocks the full layer groups' tables of `seq` take from now to its max_tokens."""
        final = seq.num_prompt_tokens + seq.params.max_tokens
        return self.windows.count(None) * max(0, self.blocks_for(final) - self.blocks_for(seq.num_tokens))

    def blocks_for(self, num_tokens: int) -> int:
        """The entries of a table holding `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def tokens_of(self, blocks: int) -> int:
        """The tokens `blocks` free blocks hold, a block of every group's a token block."""
        return blocks // self.num_groups * self.block_size

    def can_allocate(self, seq: Sequence, reserve_blocks: int = 0, chunk_tokens: int | None = None) -> bool:
        """Whether `allocate(seq, chunk_tokens=...)` would succeed, leaving `reserve_blocks` free (a
        watermark)."""
        return self.blocks_to_admit(seq, chunk_tokens) + reserve_blocks <= self.num_free_blocks

    def blocks_to_admit(self, seq: Sequence, chunk_tokens: int | None = None, use_prefix_cache: bool = True) -> int:
        """The free blocks `allocate` takes or promises for `seq`."""
        hit = self._prefix_hit(seq) if use_prefix_cache else self._no_hit(seq)
        return self._free_blocks_needed(seq, hit, self._chunk_of(seq, chunk_tokens))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._extra_blocks(seq.seq_id, num_tokens) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, use_prefix_cache: bool = True, chunk_tokens: int | None = None) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix. With
        `chunk_tokens`, where a group has a window and the sequence is not handed off, the rest
        are promised instead: the caller `grow`s the tables before each chunk of at most
        `chunk_tokens` tokens.

        Sets `seq.num_computed_tokens` to the tokens whose KV came from the cache.
        """
        chunk = self._chunk_of(seq, chunk_tokens)
        hit = self._restored_hit(seq, lambda h: self._free_blocks_needed(seq, h, chunk)) if use_prefix_cache \
            else self._no_hit(seq)
        self._take(seq, hit, chunk)

    def _take(self, seq: Sequence, hit: PrefixHit, chunk: int | None, headroom: int = 0) -> None:
        """`allocate` with its hit: per group, `hit.released` leading NULL_BLOCKs, then the hit's
        blocks; then fresh blocks to the end of the prompt (`chunk`: promised). Refused unless
        `headroom` more blocks are free."""
        if seq.seq_id in self._held:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        if self._free_blocks_needed(seq, hit, chunk) + headroom > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs more KV blocks than are free "
                                   f"({self.num_free_blocks})")
        for hits in hit.hits:
            for block_id in hits:
                self._pool.take(block_id)
        tables = [[NULL_BLOCK] * released + hits for released, hits in zip(hit.released, hit.hits)]
        held = self._held[seq.seq_id] = HeldBlocks(tables, list(hit.released), hit.blocks, hit.parent,
                                                   keep=self._keep_of(seq))
        self.num_cache_hit_blocks += hit.blocks
        seq.num_computed_tokens = hit.blocks * self.block_size
        if not seq.num_preemptions:  # a recompute hits the blocks it wrote itself: not the prompt's cache hit
            seq.num_cached_tokens = seq.num_computed_tokens
        if chunk is None:
            self.grow(seq, seq.num_tokens)
        else:
            held.chunk, held.prefill_to = chunk, seq.num_tokens
            self._keep_promise(held)

    def rechunk(self, seq: Sequence, chunk_tokens: int | None) -> bool:
        """A prompt being prefilled chunk by chunk goes on in chunks of at most `chunk_tokens`, its
        promise resized; with None it takes the rest of its blocks now. For a scheduling policy
        switch. False, changing nothing, when the free blocks cannot cover that."""
        held = self._held[seq.seq_id]
        if not held.chunk:
            return True  # it holds all its blocks
        chunk = self._chunk_of(seq, chunk_tokens)
        if chunk is None:
            if not self.try_grow(seq, held.prefill_to):
                return False
            held.chunk = 0
        elif self._need(held, chunk) > self._promises.unpromised(held.promised):
            return False
        else:
            held.chunk = chunk
        self._keep_promise(held)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block tables hold at least `num_tokens` token slots."""
        if not self.try_grow(seq, num_tokens):
            raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs {self._extra_blocks(seq.seq_id, num_tokens)} "
                                   f"more KV blocks, {self.num_free_blocks} free")

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """`grow` if the free blocks allow it (True), else change nothing (False). A prompt's
        promised blocks come first."""
        held = self._held[seq.seq_id]
        need = self.blocks_for(num_tokens)
        extra = self._table_growth(held, need)
        if extra <= 0:
            return True
        if extra > held.promised + self.num_free_blocks:
            return False
        for table in held.tables:
            if len(table) < need:
                table += self._pool.take_fresh(need - len(table))
        if held.chunk:
            self._keep_promise(held)
        return True

    def commit(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed, so later requests can share them; then,
        in windowed groups, release the blocks wholly before the window of the next query (at
        position num_computed_tokens or later), but for those a handed-off sequence's export reads."""
        held = self._held[seq.seq_id]
        if self.enable_prefix_caching:
            self._hash_computed(seq, held)
        for group, window in enumerate(self.windows):
            if window is not None:
                self._release_out_of_reach(seq, held, group, window)
        if held.chunk:
            if seq.num_computed_tokens >= held.prefill_to:
                held.chunk = 0  # prefilled: it grows as decodes do
            self._keep_promise(held)

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks (tail first, so a prefix stays cached longest)."""
        held = self._held.pop(seq_id, None)
        if held is None:
            return
        self._promises.settle(held.promised, 0)
        pool = self._pool
        for table, released in zip(held.tables, held.released):
            pool.fresh.extend(reversed(table[max(held.done, released):]))  # past the hashed prefix: private
            for block_id in reversed(table[released:held.done]):
                pool.drop(block_id)  # unhashed where it duplicates cached content

    def export_blocks(self, seq_id: str) -> list[list[int]]:
        """Per layer group, the block ids holding a sequence's KV, in token order (for a KV
        transfer out: a handed-off sequence, which holds them from its `export_from` on)."""
        return [list(table) for table in self.block_tables(seq_id)]

    def reserve_for_import(self, seq: Sequence, reuse_prefix: bool = False,
                           others: Iterable[Sequence] = ()) -> list[list[int]]:
        """Blocks for a sequence whose KV a transfer in writes. With `reuse_prefix`, cached full
        blocks of its prefix are shared (held, so never evicted meanwhile) and
        `seq.num_computed_tokens` is the number of leading tokens they hold: the transfer must
        write only the positions from there on (never the last token's, `prefix_hit`). Without,
        every block is fresh and the transfer writes them all. A windowed group reserves only the
        blocks its first decode can read: the leading ones out of its reach are NULL_BLOCK from
        the start, as `commit` releases them once the import completes (the transfer sends that
        group's KV from its first held block on). Admission asks for those it skips too, up to
        what the full groups grow by over the max_tokens of the sequence and of `others` (the
        other decodes here: read only then, `full_growth`): it never comes later than a whole
        reservation's, and the full groups' growth is not left to preemptions. Returns every
        group's table."""
        windows = [None] * self.num_groups if seq.hand_off else self.windows
        growth = self.full_growth(seq) + sum(map(self.full_growth, others))

        def reservation(hit: PrefixHit) -> tuple[PrefixHit, int]:  # its blocks, and the headroom it asks
            reserved = released_to(hit, [self._first_needed(seq.num_tokens, w) for w in windows])
            skipped = sum(reserved.released) - sum(hit.released)
            return reserved, min(skipped, growth) if skipped else 0

        def need(hit: PrefixHit) -> int:
            reserved, headroom = reservation(hit)
            return self._free_blocks_needed(seq, reserved, None) + headroom

        hit = self._restored_hit(seq, need) if reuse_prefix else self._no_hit(seq)
        reserved, headroom = reservation(hit)
        self._take(seq, reserved, None, headroom)
        return self.export_blocks(seq.seq_id)

    def take_prefix_delta(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prefix cache's net change since the last take (or snapshot): the hashes cached,
        oldest first, and the hashes evicted (group 0's: the ingress names blocks by them)."""
        return self._pool.take_delta()

    def take_prefix_snapshot(self) -> tuple[int, ...]:
        """Every hash cached now (group 0's), oldest first; the next delta counts from here."""
        return self._pool.take_snapshot()

    # ---- internals -----------------------------------------------------------------------
    def _hash_computed(self, seq: Sequence, held: HeldBlocks) -> None:
        full = min(seq.num_computed_tokens // self.block_size, len(held.tables[0]))
        parent, register = held.parent, self._pool.register
        for i in range(held.done, full):
            key = block_key(parent, seq.token_ids, i, self.block_size)
            parent = hash(key)  # the chain follows content, registered or not
            for group, table in enumerate(held.tables):
                if i >= held.released[group]:  # an import's windowed tables reserve no block out of reach
                    written = register(group, table[i], key, parent)
                    if written and not group and (i + 1) * self.block_size <= seq.num_prompt_tokens \
                            and not seq.num_preemptions:
                        seq.num_cache_write_tokens += self.block_size
        if full > held.done:
            held.done, held.parent = full, parent

    def _release_out_of_reach(self, seq: Sequence, held: HeldBlocks, group: int, window: int) -> None:
        """A query at p >= num_computed_tokens reads positions > p - window: the blocks that end
        at or before num_computed_tokens - window + 1 are never read again. Hashing comes first,
        so a released block that was cached stays cached (evictable) for later prefix hits."""
        table, released = held.tables[group], held.released[group]
        reach = self._first_needed(seq.num_computed_tokens, window)
        if held.keep is not None:
            reach = min(reach, held.keep[group])
        for i in range(released, reach):
            self._pool.drop(table[i])
            table[i] = NULL_BLOCK
        if reach > released:
            held.released[group] = reach

    def _extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        held = self._held[seq_id]
        return max(0, self._table_growth(held, self.blocks_for(num_tokens)) - held.promised)

    @staticmethod
    def _table_growth(held: HeldBlocks, entries: int) -> int:
        """The blocks that make every table `entries` long (an import's tables may start shorter
        where a windowed group's reach begins past the prefix hit)."""
        return sum(max(0, entries - len(table)) for table in held.tables)

    def _chunk_of(self, seq: Sequence, chunk_tokens: int | None) -> int | None:
        """The chunk bound a sequence is allocated by: None (all at once) unless a group has a
        window it will release (a handed-off sequence: one naming where its export reads from)."""
        if chunk_tokens is None or (seq.hand_off and not seq.export_from) or all(w is None for w in self.windows):
            return None
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens

    @staticmethod
    def _count(held: HeldBlocks) -> int:
        return sum(len(table) for table in held.tables) - sum(held.released)

    def _need(self, held: HeldBlocks, chunk: int) -> int:
        """The blocks a prompt's prefill in chunks of at most `chunk` tokens takes beyond those it holds."""
        return self._promises.peak(held.prefill_to, held.released, chunk, held.keep) - self._count(held)

    def _keep_promise(self, held: HeldBlocks) -> None:
        """A sequence prefilled chunk by chunk is promised what its prefill still needs."""
        held.promised = self._promises.settle(held.promised, self._need(held, held.chunk) if held.chunk else 0)

    def _free_blocks_needed(self, seq: Sequence, hit: PrefixHit, chunk: int | None = None) -> int:
        hashed = self._pool.hashed
        revived = sum(1 for hits in hit.hits for b in hits if hashed[b].ref_count == 0)  # cached but free
        peak = self._promises.peak(seq.num_tokens, hit.released, chunk, self._keep_of(seq))
        return peak - sum(len(hits) for hits in hit.hits) + revived

    def _no_hit(self, seq: Sequence) -> PrefixHit:
        return no_hit(self.num_groups, self._root_of(seq))

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """`prefix_hit.find_hit` where the prefix cache serves the sequence; a handed-off one takes
        its hit whole (every group as a full one: the export may read every block), then releases
        what is out of reach and before `_keep_of`."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return self._no_hit(seq)
        if not seq.hand_off:
            return find_hit(self._pool, seq, self.windows, self.block_size, self._root_of(seq))
        return handed_off_hit(self._pool, seq, self.windows, self.block_size, self._root_of(seq), self._keep_of(seq))

    def _restored_hit(self, seq: Sequence, need: Callable[[PrefixHit], int]) -> PrefixHit:
        """`_prefix_hit`, after the host tier's blocks of the prefix are restored (`prefix_restore`)."""
        if self._pool.host_tier is None or not self.enable_prefix_caching or seq.needs_prompt_logits:
            return self._prefix_hit(seq)
        return restored_hit(self._pool, seq, self.windows, self.block_size, self._root_of(seq),
                            lambda: self._prefix_hit(seq), need)

    def _keep_of(self, seq: Sequence) -> tuple[int, ...] | None:
        """Per group, the first block a sequence never releases: for a handed-off one the block of
        its `export_from` (0 without: it keeps every block); None for the rest (no bound)."""
        if not seq.hand_off:
            return None
        return tuple(start // self.block_size for start in seq.export_from) or (0,) * self.num_groups

    def _first_needed(self, num_tokens: int, window: int | None) -> int:
        return first_needed(num_tokens, window, self.block_size)

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the first broken invariant (the module's, and the pool's)."""
        self._promises.check([held.promised for held in self._held.values()])
        check_tables(self._pool, self._held)
