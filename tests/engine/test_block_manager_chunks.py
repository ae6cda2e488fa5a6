"""`BlockManager.allocate(chunk_tokens=...)`: a prompt of a model with a windowed layer group,
prefilled chunk by chunk, takes its blocks as its chunks go; the most it holds at once is promised
at admission and counted out of the free blocks, so a grow before a chunk never waits."""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager
from tests.engine.block_helpers import BS, cached, make_seq, seq_range

WINDOW = 8  # two blocks of BS


def promised(bm: BlockManager, seq_id: str) -> int:
    """The blocks promised to a sequence: what it is counted for, less the blocks its tables hold."""
    null = NULL_BLOCK if any(w is not None for w in bm.windows) else None
    held = sum(len(t) - t.count(null) for t in bm.block_tables(seq_id))
    return bm.num_held_blocks(seq_id) - held


def prefill(bm: BlockManager, seq, sizes) -> int:
    """Compute `seq`'s prompt in chunks of `sizes` (cycled), growing before each; returns the most
    blocks it held and was promised at once."""
    most, sizes = 0, list(sizes)
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(sizes[0], seq.num_tokens - seq.num_computed_tokens)
        sizes = sizes[1:] + sizes[:1]
        assert bm.try_grow(seq, seq.num_computed_tokens + n), "a grow out of the promise failed"
        most = max(most, bm.num_held_blocks(seq.seq_id))
        seq.num_computed_tokens += n
        bm.commit(seq)
        bm.check_integrity()
    return most


def test_a_prompt_longer_than_the_free_blocks_is_admitted_to_be_prefilled_chunk_by_chunk():
    bm = BlockManager(9, BS, windows=(WINDOW,))  # 8 usable blocks
    seq = make_seq("a", seq_range(0, 15 * BS))
    assert not bm.can_allocate(seq)  # whole: 15 blocks
    peak = bm.blocks_for(BS + WINDOW - 1) + 1  # a chunk of BS tokens and the window before it
    assert bm.blocks_to_admit(seq, chunk_tokens=BS) == peak == 4
    bm.allocate(seq, chunk_tokens=BS)
    assert bm.block_table("a") == [] and promised(bm, "a") == peak
    assert bm.num_free_blocks == 8 - peak and bm.num_used_blocks == peak
    assert prefill(bm, seq, [BS]) <= peak
    assert promised(bm, "a") == 0  # prefilled: it grows as a decode does
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_promised_blocks_are_not_free_to_others():
    bm = BlockManager(9, BS, windows=(WINDOW,))
    long = make_seq("long", seq_range(0, 15 * BS))
    bm.allocate(long, chunk_tokens=BS)
    other = make_seq("other", seq_range(100, 4 * BS + 1))
    assert not bm.can_allocate(other)  # 5 blocks, 4 not promised
    bm.allocate(make_seq("fits", seq_range(200, 4 * BS)))
    assert bm.num_free_blocks == 0
    assert prefill(bm, long, [BS]) <= 4  # every grow drew on the promise


@pytest.mark.parametrize("windows", [(None,), (WINDOW, None)])
def test_a_full_attention_model_or_a_handed_off_prompt_takes_every_block_at_admission(windows):
    bm = BlockManager(64, BS, windows=windows)
    seq = make_seq("a", seq_range(0, 6 * BS))
    bm.allocate(seq, chunk_tokens=BS)
    if windows == (None,):
        assert len(bm.block_table("a")) == 6 and promised(bm, "a") == 0
    handed = make_seq("b", seq_range(50, 6 * BS))
    handed.hand_off = True  # its export reads every position: nothing is released
    bm.allocate(handed, chunk_tokens=BS)
    assert [len(t) for t in bm.block_tables("b")] == [6] * len(windows) and promised(bm, "b") == 0
    bm.check_integrity()


def random_prompt(rng: random.Random):
    """A block manager of random windowed layer groups, a prompt whose random prefix it may hold
    cached (freed), and a random chunk bound: (manager, prompt, chunk)."""
    window, chunk = rng.randint(1, 20), rng.randint(1, 20)
    bm = BlockManager(200, BS, windows=rng.choice([(window,), (None, window), (window, window + 3)]))
    prefix = seq_range(0, rng.randint(0, 6 * BS))
    if prefix:
        cached(bm, "cached", prefix + [99])
        bm.free("cached")
    return bm, make_seq("a", prefix + seq_range(300, rng.randint(1, 12 * BS))), chunk


def test_the_peak_bounds_every_chunking_of_every_prompt():
    """Chunks of any sizes up to the bound, with or without a prefix hit: the blocks held never
    pass what was promised at admission, so no grow fails."""
    rng = random.Random(0)
    for _ in range(300):
        bm, seq, chunk = random_prompt(rng)
        need, free = bm.blocks_to_admit(seq, chunk), bm.num_free_blocks
        assert need <= bm.blocks_to_admit(seq)  # never more than taking every block now
        bm.allocate(seq, chunk_tokens=chunk)
        assert bm.num_free_blocks == free - need
        peak = bm.num_held_blocks("a")  # the hit's blocks and the promise
        assert prefill(bm, seq, [rng.randint(1, chunk) for _ in range(5)]) <= peak


def test_a_handed_off_prompt_keeps_the_windowed_blocks_its_export_reads_and_releases_the_rest():
    """A prompt handed off with `export_from` (where the token worker's window starts receiving):
    its windowed tables release what their window passed, but never a block holding a position
    the export sends; prefilled in chunks of any sizes, with or without a prefix hit (taken whole
    first), it holds no more than it was promised at admission."""
    rng = random.Random(1)
    for _ in range(300):
        bm, seq, chunk = random_prompt(rng)
        seq.hand_off, seq.export_from = True, tuple(rng.randrange(seq.num_tokens) for _ in bm.windows)
        need = bm.blocks_to_admit(seq, chunk)
        assert need <= bm.blocks_to_admit(seq)
        bm.allocate(seq, chunk_tokens=chunk)
        peak = bm.num_held_blocks("a")
        assert prefill(bm, seq, [rng.randint(1, chunk) for _ in range(5)]) <= peak
        for table, window, start in zip(bm.block_tables("a"), bm.windows, seq.export_from):
            released = 0 if window is None else min(max(0, seq.num_tokens - window + 1) // BS, start // BS)
            assert table[:released] == [NULL_BLOCK] * released and NULL_BLOCK not in table[released:]
            assert len(table) == bm.blocks_for(seq.num_tokens)
        bm.free("a")
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_integrity()


def test_rechunk_takes_the_rest_now_or_resizes_the_promise():
    bm = BlockManager(20, BS, windows=(WINDOW,))  # 19 usable blocks
    seq = make_seq("a", seq_range(0, 12 * BS))
    bm.allocate(seq, chunk_tokens=BS)
    assert bm.try_grow(seq, BS)
    seq.num_computed_tokens = BS
    bm.commit(seq)
    assert promised(bm, "a") == 4 - 1  # a peak of blocks_for(BS + WINDOW - 1) + 1, one held
    assert bm.rechunk(seq, 3 * BS) and promised(bm, "a") == 6 - 1  # blocks_for(3 * BS + WINDOW - 1) + 1
    bm.allocate(make_seq("blocker", seq_range(100, 10 * BS)))
    assert bm.num_free_blocks == 19 - 6 - 10
    assert not bm.rechunk(seq, None)  # 11 more blocks at once: 5 promised and 3 free are too few
    assert len(bm.block_table("a")) == 1 and promised(bm, "a") == 5
    bm.free("blocker")
    assert bm.rechunk(seq, None)
    assert len(bm.block_table("a")) == 12 and promised(bm, "a") == 0
    bm.check_integrity()


def test_a_promise_falls_short_only_where_released_blocks_stay_shared():
    """A prompt whose prefix hit shares a windowed block with a running sequence releases it as
    it advances, which frees nothing: with no other free block, a later grow may find its promise
    short (the scheduling policy then preempts it). With the block freed instead, it never does."""
    for shared in (True, False):
        bm = BlockManager(8, BS, windows=(BS,))
        holder = cached(bm, "holder", seq_range(0, 2 * BS))  # holds block 1 (block 0 is out of reach)
        seq = make_seq("a", seq_range(0, 8 * BS))
        bm.allocate(seq, chunk_tokens=BS + 1)
        assert seq.num_computed_tokens == 2 * BS
        if not shared:
            bm.free(holder.seq_id)
        filler = make_seq("filler", seq_range(100, BS * bm.num_free_blocks))
        bm.allocate(filler)  # every block not promised
        grew = []
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(BS + 1, seq.num_tokens - seq.num_computed_tokens)
            grew.append(bm.try_grow(seq, seq.num_computed_tokens + n))
            if not grew[-1]:
                break
            seq.num_computed_tokens += n
            bm.commit(seq)
            bm.check_integrity()
        assert all(grew) != shared
