"""The randomized engine `test_block_manager_stress.py` runs on a `BlockManager` (`EngineSim`), and
the KV cache it simulates (`KVSim`); see that module for what they check."""
from __future__ import annotations

import random

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager, OutOfBlocksError
from splitserve.engine.host_kv_tier import HostKVTier
from splitserve.engine.sequence import Sequence
from tests.engine.block_helpers import BS, make_seq


def windows_any(windows: tuple[int | None, ...]) -> bool:
    return any(w is not None for w in windows)


class KVSim:
    """A fake KV cache: each slot holds the id of the token prefix whose last token it encodes;
    `host` the host tier's blocks (it is that tier's `BlockMover`). A write-through copy runs as
    late as a side stream may: at the next fence, reading the device block as it is then."""

    def __init__(self, num_blocks: int, block_size: int, host_slots: int = 0):
        self.bs = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(host_slots)]
        self._ids: dict[tuple[int, int], int] = {}
        self._unfenced: list[tuple[int, int]] = []  # (block id, slot) written, copied at the fence

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        for block_id, slot in zip(block_ids, slots):
            self.host[slot] = list(self.slots[block_id])

    def write(self, block_ids: list[int], slots: list[int]) -> None:
        self._unfenced += zip(block_ids, slots)

    def fence(self) -> None:
        for block_id, slot in self._unfenced:
            self.host[slot] = list(self.slots[block_id])
        self._unfenced.clear()

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        for slot, block_id in zip(slots, block_ids):
            self.slots[block_id] = list(self.host[slot])

    def prefix_ids(self, tokens: list[int]) -> list[int]:
        out, prev = [], -1
        for t in tokens:
            prev = self._ids.setdefault((prev, t), len(self._ids))
            out.append(prev)
        return out

    def compute(self, tables: list[list[int]], tokens: list[int], start: int, end: int) -> None:
        ids = self.prefix_ids(tokens[:end])
        for group, table in enumerate(tables):
            for p in range(start, end):
                self.slots[table[p // self.bs]][p % self.bs] = (group, ids[p])

    def check(self, seq: Sequence, table: list[int], group: int, first: int = 0) -> None:
        """Positions `first` on of the group's table hold their own prefix's KV, of that group."""
        ids = self.prefix_ids(seq.token_ids[:seq.num_computed_tokens])
        for p, want in enumerate(ids[first:], first):
            want = (group, want)
            got = self.slots[table[p // self.bs]][p % self.bs]
            assert got == want, (
                f"{seq.seq_id}: KV at position {p} (block {table[p // self.bs]}) was computed for "
                f"another prefix; computed={seq.num_computed_tokens} tokens={seq.token_ids}")


class EngineSim:
    """A randomized engine on top of a `BlockManager`, with the KV cache simulated by `KVSim`.

    `run(num_ops)` performs random operations (new request, admit, import, step, finish, preempt),
    checks every invariant after each, and returns counters of what was exercised.
    """

    def __init__(self, seed: int, enable_prefix_caching: bool = True, num_blocks: int = 24,
                 block_size: int = BS, windows: tuple[int | None, ...] = (None,), chunk: int | None = None,
                 host_slots: int = 0, write_through: bool = False):
        self.seed = seed
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.bs = block_size
        self.windows = windows
        self.enable_prefix_caching = enable_prefix_caching
        self.kv = KVSim(num_blocks, block_size, host_slots)
        self.tier = HostKVTier(host_slots, len(windows), self.kv, write_through) if host_slots else None
        self.bm = BlockManager(num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                               windows=windows, host_tier=self.tier)
        self.num_blocks = self.bm.num_blocks  # less NULL_BLOCK with a window
        # block-sized chunks, shared across prompts at various positions, plus shared prefixes
        self.chunks = [[self.rng.randrange(8) for _ in range(block_size)] for _ in range(5)]
        self.prefixes = [[t for _ in range(k) for t in self.rng.choice(self.chunks)]
                         for k in (1, 2, 2, 3)]
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # admission order: the youngest is last
        self.counter = 0
        self.stats = dict(admitted=0, hits=0, hit_tokens=0, preempted=0, finished=0, imported=0, import_hits=0,
                          steps=0, shared_seen=0, out_of_blocks_admit=0, released=0, chunked=0, short=0,
                          handed_off_released=0)

    # -- the operation loop --------------------------------------------------------------------

    def run(self, num_ops: int) -> dict:
        for _ in range(num_ops):
            self.random_op()
            self.check_all()
        self.drain()
        if self.tier is not None:
            self.stats.update(saved=self.tier.saved_blocks, restored=self.tier.restored_blocks)
        return self.stats

    def random_op(self) -> None:
        rng, waiting, running = self.rng, self.waiting, self.running
        r = rng.random()
        if r < 0.12 or not (waiting or running):
            waiting.append(self.new_seq())
        elif r < 0.35 and waiting:
            self.admit(rng.choice(waiting[:3]))
        elif r < 0.40 and waiting:
            self.import_seq(rng.choice(waiting))
        elif r < 0.93 and running:
            self.step(rng.choice(running))
        elif r < 0.96 and running:
            self.finish(rng.choice(running))
        elif running:
            self.preempt(rng.choice(running))

    def drain(self) -> None:
        """Finish every running sequence; every block must come back."""
        bm = self.bm
        for s in list(self.running):
            self.finish(s)
            bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.num_used_blocks == 0
        bm.check_integrity()

    # -- operations ----------------------------------------------------------------------------

    def new_seq(self) -> Sequence:
        rng, bs = self.rng, self.bs
        self.counter += 1
        tokens = list(rng.choice(self.prefixes)) if rng.random() < 0.8 else []
        for _ in range(rng.randrange(3)):
            tokens += rng.choice(self.chunks)
        tokens += [rng.randrange(8) for _ in range(rng.randrange(bs + 1))]
        if not tokens:
            tokens = [rng.randrange(8)]
        longest = self.num_blocks // (2 * len(self.windows)) * bs  # half the cache at most
        tokens = tokens[: longest * (2 if self.chunk else 1)]  # when chunked, windowed tables hold less
        seq = make_seq(f"s{self.seed}-{self.counter}", tokens, max_tokens=rng.randint(1, 3 * bs))
        seq.hand_off = windows_any(self.windows) and rng.random() < 0.2
        if seq.hand_off and rng.random() < 0.6:  # its export reads from there on (else every block)
            seq.export_from = tuple(rng.randrange(seq.num_tokens) for _ in self.windows)
        return seq

    def preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        self.stats["preempted"] += 1

    def finish(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        self.stats["finished"] += 1

    def grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """grow(seq), preempting the youngest running sequence while short. False if `seq` itself
        got preempted."""
        bm = self.bm
        while True:
            can = bm.can_grow(seq, num_tokens)
            try:
                bm.grow(seq, num_tokens)
            except OutOfBlocksError:
                assert not can, "can_grow said yes but grow raised"
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            assert can, "can_grow said no but grow succeeded"
            assert len(bm.block_table(seq.seq_id)) >= bm.blocks_for(num_tokens)
            return True

    def admit(self, seq: Sequence) -> None:
        bm, stats = self.bm, self.stats
        can = bm.can_allocate(seq, chunk_tokens=self.chunk)
        free_before, restored = bm.num_free_blocks, self.restored()
        try:
            bm.allocate(seq, chunk_tokens=self.chunk)
        except OutOfBlocksError:
            assert not can, "can_allocate said yes but allocate raised"
            assert not bm.has_blocks(seq.seq_id) and bm.num_free_blocks == free_before
            stats["out_of_blocks_admit"] += 1
            return
        # a restored prefix's longer hit may need fewer blocks where a group has a window
        assert can or (self.restored() > restored and windows_any(self.windows)), \
            "can_allocate said no but allocate succeeded"
        self.waiting.remove(seq)
        self.running.append(seq)
        stats["admitted"] += 1
        n = seq.num_computed_tokens
        assert n == seq.num_cached_tokens or seq.num_preemptions
        assert n % self.bs == 0 and n < seq.num_tokens
        if not self.enable_prefix_caching:
            assert n == 0
        if n:
            stats["hits"] += 1
            stats["hit_tokens"] += n
        if self.is_chunked(seq):
            assert len(bm.block_table(seq.seq_id)) == bm.blocks_for(n), "a chunked prompt took blocks at admission"
            stats["chunked"] += 1
        else:
            assert len(bm.block_table(seq.seq_id)) == bm.blocks_for(seq.num_tokens)

    def restored(self) -> int:
        return 0 if self.tier is None else self.tier.restored_blocks

    def is_chunked(self, seq: Sequence) -> bool:
        """Whether `seq`, admitted now, takes its blocks chunk by chunk."""
        return self.chunk is not None and windows_any(self.windows) and (not seq.hand_off or bool(seq.export_from))

    def keep(self, seq: Sequence, group: int) -> int:
        """The first block a sequence never releases in `group`: a handed-off one keeps what its
        export reads, every block without `export_from`."""
        if not seq.hand_off:
            return 1 << 30
        return seq.export_from[group] // self.bs if seq.export_from else 0

    def import_seq(self, seq: Sequence) -> None:
        """As `Policy.reserve_import` (through the prefix cache or not), then `complete_import` once
        the transfer wrote the rest of the prompt's KV (into the reserved block where a windowed
        group's reach starts later)."""
        if seq.export_from:
            return  # a prompt worker's hand-off (its export's reach named): never an import
        bm, num_prompt = self.bm, seq.num_tokens
        reach = [0 if w is None or seq.hand_off else max(0, num_prompt - w + 1) // self.bs for w in self.windows]
        reuse = self.enable_prefix_caching and self.rng.random() < 0.5
        others = {b for s in self.running for table in bm.block_tables(s.seq_id) for b in table}
        others -= {NULL_BLOCK} if windows_any(self.windows) else set()
        free_before = bm.num_free_blocks
        try:
            ids = bm.reserve_for_import(seq, reuse_prefix=reuse)
        except OutOfBlocksError:  # a prefix hit only lowers the need; room asked for the full groups' growth
            growth = self.windows.count(None) * (bm.blocks_for(num_prompt + seq.params.max_tokens)
                                                 - bm.blocks_for(num_prompt))
            assert sum(bm.blocks_for(num_prompt) - r for r in reach) + min(sum(reach), growth) > free_before
            assert not bm.has_blocks(seq.seq_id)
            return
        hit = seq.num_computed_tokens
        assert hit == 0 or reuse
        tables = bm.block_tables(seq.seq_id)
        assert ids == tables
        assert [table[:r] for table, r in zip(tables, reach)] == [[NULL_BLOCK] * r for r in reach]
        mine = [b for table, r in zip(tables, reach) for b in table[r:]]
        assert len(set(mine)) == len(mine) and not (windows_any(self.windows) and NULL_BLOCK in mine)
        assert free_before - bm.num_free_blocks == len(set(mine) - others), "an import took a held block"
        assert all(i < hit // self.bs for table in tables for i, b in enumerate(table) if b in others), \
            "an import shares a block it is to write"
        self.waiting.remove(seq)
        self.running.append(seq)
        self.kv.compute(tables, seq.token_ids, hit, num_prompt)
        seq.num_computed_tokens = num_prompt
        bm.commit(seq)
        seq.append_token(self.rng.randrange(8))  # the first token, sampled by the prefill instance
        self.stats["imported"] += 1
        self.stats["import_hits"] += hit > 0

    def step(self, seq: Sequence) -> None:
        rng, bm = self.rng, self.bm
        self.stats["steps"] += 1
        c = seq.num_computed_tokens
        prefilling = self.chunk is not None and not seq.is_decoding
        n = rng.randint(1, min(seq.num_uncomputed_tokens, self.chunk if prefilling else 2 * self.bs + 1))
        if prefilling:  # as `Policy._chunk`: out of the promise, else the prompt is preempted
            promise = bm.num_held_blocks(seq.seq_id) - sum(len(t) - t.count(NULL_BLOCK)
                                                           for t in bm.block_tables(seq.seq_id))
            extra = (bm.blocks_for(c + n) - len(bm.block_table(seq.seq_id))) * bm.num_groups
            if not bm.try_grow(seq, c + n):
                assert extra > promise, f"{seq.seq_id}: {extra} blocks beyond its table, {promise} promised"
                self.stats["short"] += 1
                self.preempt(seq)
                return
        elif not self.grow_or_preempt(seq, c + n):
            return
        tables = bm.block_tables(seq.seq_id)
        for table in tables:
            self.assert_private_writes(seq, table, c, c + n)
        self.kv.compute(tables, seq.token_ids, c, c + n)
        seq.num_computed_tokens = c + n
        bm.commit(seq)
        if self.tier is not None and self.tier.write_through and self.rng.random() < 0.5:
            self.tier.flush()  # as a step's end does; the tier flushes before it reuses a block either way
        if seq.num_computed_tokens == seq.num_tokens:  # sampled a token
            seq.append_token(rng.randrange(8))
            if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.03:
                self.finish(seq)
                return
            self.grow_or_preempt(seq, seq.num_tokens)

    # -- checks --------------------------------------------------------------------------------

    def assert_private_writes(self, seq: Sequence, table: list[int], start: int, end: int) -> None:
        """A write never lands on a block another table holds."""
        bs, bm = self.bs, self.bm
        for p in range(start, end):
            block = table[p // bs]
            assert not windows_any(self.windows) or block != NULL_BLOCK, f"{seq.seq_id} writes into NULL_BLOCK"
            holders = [s.seq_id for s in self.running
                       if s is not seq and any(block in table for table in bm.block_tables(s.seq_id))]
            assert not holders, f"{seq.seq_id} writes position {p} into block {block} shared with {holders}"

    def check_all(self) -> None:
        bm = self.bm
        bm.check_integrity()
        holders: dict[int, list[tuple[Sequence, int, int]]] = {}
        used = set()
        promised = 0
        for s in self.running:
            assert 0 <= s.num_computed_tokens < s.num_tokens
            held = 0
            for group, (table, window) in enumerate(zip(bm.block_tables(s.seq_id), self.windows)):
                assert bm.blocks_for(s.num_computed_tokens) <= len(table) <= bm.blocks_for(s.num_tokens)
                first = 0 if window is None else max(0, s.num_computed_tokens - window + 1)
                released = min(first // self.bs, self.keep(s, group))  # the leading entries out of reach
                first = first if released == first // self.bs else released * self.bs
                assert table[:released] == [NULL_BLOCK] * released
                assert not windows_any(self.windows) or NULL_BLOCK not in table[released:]
                self.stats["released"] += released
                self.stats["handed_off_released"] += released if s.hand_off else 0
                self.kv.check(s, table, group, first)
                for i, b in enumerate(table[released:], released):
                    holders.setdefault(b, []).append((s, group, i))
                    used.add(b)
                held += len(table) - released
            promised += bm.num_held_blocks(s.seq_id) - held
            if self.is_chunked(s) and not s.is_decoding:
                whole = bm.blocks_for(s.num_tokens)
                peak = sum(whole if w is None else max(bm.blocks_for(self.chunk + w - 1) + 1,
                                                       whole - self.keep(s, group))
                           for group, w in enumerate(self.windows))
                assert bm.num_held_blocks(s.seq_id) <= peak, f"{s.seq_id} holds and is promised past its peak"
            elif len(bm.block_table(s.seq_id)) != bm.blocks_for(s.num_tokens):
                assert s.is_decoding, f"{s.seq_id}: a prompt taken whole lacks blocks"
        for s in self.waiting:
            assert not bm.has_blocks(s.seq_id) and s.num_computed_tokens == 0
        assert bm.num_used_blocks == len(used) + promised
        assert bm.num_free_blocks == self.num_blocks - len(used) - promised
        for b, hs in holders.items():
            if len(hs) >= 2:
                self.check_shared_block(b, hs)

    def check_shared_block(self, b: int, hs: list[tuple[Sequence, int, int]]) -> None:
        """Block `b` is held by every (sequence, group, index) in `hs`: it must be the same fully
        computed block of the same group after the very same prefix in each."""
        bs = self.bs
        self.stats["shared_seen"] += 1
        assert self.enable_prefix_caching, f"block {b} shared with prefix caching disabled"
        s0, g0, i0 = hs[0]
        for s, g, i in hs[1:]:
            assert (g, i) == (g0, i0), f"block {b} is block {i0} of group {g0} of {s0.seq_id} but {i} of {g}"
            end = (i + 1) * bs
            assert end <= s0.num_computed_tokens and end <= s.num_computed_tokens, (
                f"shared block {b} not fully computed in both {s0.seq_id} and {s.seq_id}")
            assert s.token_ids[i * bs:end] == s0.token_ids[i * bs:end]
            assert s.token_ids[:end] == s0.token_ids[:end], (
                f"shared block {b} follows different prefixes in {s0.seq_id} and {s.seq_id}")

