"""`BlockManager` with a window (every layer of the model slides): blocks out of the window's reach
are released as a sequence advances, and a prefix hit needs only the cached blocks within the
window of its end."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager
from tests.engine.block_helpers import BS, cached, compute_all, make_seq, seq_range

WINDOW = 8  # two blocks of BS


def released(bm: BlockManager, seq_id: str) -> int:
    table = bm.block_table(seq_id)
    return len(table) - bm.num_held_blocks(seq_id)


def step(bm: BlockManager, seq, tokens: int = 1) -> None:
    """A step computed `tokens` more of `seq` (growing it by as many sampled ones), then committed."""
    seq.token_ids += [7] * tokens
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens += tokens
    bm.commit(seq)
    bm.check_integrity()


def test_null_block_is_never_handed_out():
    bm = BlockManager(6, BS, windows=(WINDOW,))
    assert bm.num_blocks == 5 and bm.num_free_blocks == 5
    seq = make_seq("a", seq_range(0, 5 * BS))
    bm.allocate(seq)
    assert NULL_BLOCK not in bm.block_table("a") and bm.num_free_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_a_sequence_holds_about_a_window_of_blocks_however_long_it_grows(caching):
    bm = BlockManager(32, BS, enable_prefix_caching=caching, windows=(WINDOW,))
    seq = make_seq("a", seq_range(0, 3))
    bm.allocate(seq)
    for computed in range(3, 100):
        step(bm, seq)
        # the next query (at `computed` + 1 - 1 = num_computed_tokens) reads positions > it - WINDOW
        first_read = seq.num_computed_tokens - WINDOW + 1
        assert released(bm, "a") == max(0, first_read) // BS
        assert bm.block_table("a")[:released(bm, "a")] == [NULL_BLOCK] * released(bm, "a")
        assert bm.num_held_blocks("a") <= -(-WINDOW // BS) + 2
    assert bm.num_used_blocks == bm.num_held_blocks("a")
    bm.free("a")
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def test_a_handed_off_sequence_keeps_every_block_for_its_export():
    """Its export reads every position: it releases none, and its prefix hit is whole."""
    bm = BlockManager(32, BS, windows=(WINDOW,))
    seq = make_seq("a", seq_range(0, 40))
    seq.hand_off = True
    bm.allocate(seq)
    compute_all(bm, seq)
    assert NULL_BLOCK not in bm.export_blocks("a")[0] and bm.num_held_blocks("a") == 10
    bm.free("a")
    again = make_seq("b", seq_range(0, 44))
    again.hand_off = True
    bm.allocate(again)
    assert again.num_computed_tokens == 40 and NULL_BLOCK not in bm.export_blocks("b")[0]
    bm.check_integrity()


def cache_40_tokens_then_evict(window: int | None, evicted: int) -> BlockManager:
    """A computed 40 tokens (10 blocks) and left; a filler then took every fresh block and
    `evicted` cached ones, least recently freed first, and left too. With a window A's blocks 0-7
    were freed first (released in order as it advanced), then 9 and 8 (a table is freed tail
    first); without, 9 down to 0."""
    bm = BlockManager(24, BS, windows=(window,))
    cached(bm, "a", seq_range(0, 40))
    bm.free("a")
    bm.allocate(make_seq("filler", seq_range(1000, (bm.num_free_blocks - 10 + evicted) * BS)))
    bm.free("filler")
    bm.check_integrity()
    return bm


@pytest.mark.parametrize("window,evicted,hit_blocks", [(WINDOW, 0, 10), (WINDOW, 8, 10), (WINDOW, 9, 0),
                                                       (None, 0, 10), (None, 8, 2)])
def test_a_hit_needs_only_the_cached_blocks_in_the_window_of_its_end(window, evicted, hit_blocks):
    """B is A's 40 tokens and 4 more: its hit can end at block 10 (the last token is never
    covered). With a window it needs blocks 8 and 9 alone for that (a query at 40 reads 33 on),
    however many before them are gone; once 9 is, no shorter hit has its window either. Without
    a window a hit is the cached run from block 0."""
    bm = cache_40_tokens_then_evict(window, evicted)
    b = make_seq("b", seq_range(0, 40) + [5, 6, 7, 8])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == hit_blocks * BS
    table = bm.block_table("b")
    skipped = max(0, hit_blocks * BS - WINDOW + 1) // BS if window else 0
    assert table[:skipped] == [NULL_BLOCK] * skipped
    assert window is None or NULL_BLOCK not in table[skipped:]  # without a window, block 0 is a block
    assert bm.num_held_blocks("b") == bm.blocks_for(b.num_tokens) - skipped
    bm.check_integrity()


@pytest.mark.parametrize("window", [WINDOW, None])
def test_a_hit_takes_only_its_window_blocks_from_the_pool(window):
    """B (14 blocks) hits A's 10 cached ones. With a window it takes the two within reach and 4
    new ones, 6 of the 12 blocks; without, the whole hit and 4 new ones are 14: it does not fit."""
    bm = BlockManager(12 + (window is not None), BS, windows=(window,))
    tokens = seq_range(0, 40)
    cached(bm, "a", tokens)
    bm.free("a")
    b = make_seq("b", tokens + seq_range(500, 4 * BS))
    assert bm.can_allocate(b) == (window is not None)
    if window:
        bm.allocate(b)
        assert b.num_computed_tokens == 40 and bm.num_held_blocks("b") == 6 == bm.num_used_blocks
        bm.check_integrity()
