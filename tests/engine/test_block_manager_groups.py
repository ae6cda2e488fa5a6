"""`BlockManager` with layer groups (a full group and a windowed one, as Gemma 2 and GPT-OSS
have): one pool, a table per group per sequence, windowed tables releasing, hits every group can
serve."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager
from tests.engine.block_helpers import BS, cached, make_seq, seq_range

HYBRID = (None, 8)  # group 0 attends to the whole context, group 1 to a window of two blocks


def test_every_group_has_a_table_from_one_pool():
    bm = BlockManager(24, BS, windows=HYBRID)
    assert bm.num_groups == 2 and bm.num_blocks == 23  # less NULL_BLOCK
    a = cached(bm, "a", seq_range(0, 40))
    full, windowed = bm.block_tables("a")
    assert bm.block_table("a") is full and len(full) == len(windowed) == 10
    assert windowed[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in full + windowed[8:]
    assert not set(full) & set(windowed[8:])
    assert bm.num_held_blocks("a") == 12 == bm.num_used_blocks
    assert a.num_computed_tokens == 40
    bm.free("a")
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def test_growth_takes_a_block_per_group_or_none():
    bm = BlockManager(5, BS, windows=HYBRID)  # 4 blocks to hand out
    seq = make_seq("a", seq_range(0, 2 * BS))
    bm.allocate(seq)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(seq, 2 * BS + 1) and not bm.try_grow(seq, 2 * BS + 1)
    assert [len(t) for t in bm.block_tables("a")] == [2, 2]
    bm.check_integrity()


@pytest.mark.parametrize("evicted,hit_blocks", [(0, 10), (8, 10), (10, 0)])
def test_a_hit_needs_the_full_group_s_prefix_and_the_window_s_blocks(evicted, hit_blocks):
    """A computed 40 tokens and left; a filler (two blocks a token block: one per group) then
    evicted `evicted` cached blocks, least recently freed first: the windowed group's blocks 0-7
    (released as A advanced), then the full group's 9 down to 0, then the windowed group's 9 and
    8. B (A's tokens and 4 more) hits all 10 blocks while the full group has them all and the
    windowed group its last two; once the full group lost blocks 9 and 8, a shorter hit would need
    windowed blocks that are gone: none."""
    bm = BlockManager(49, BS, windows=HYBRID)
    cached(bm, "a", seq_range(0, 40))
    bm.free("a")
    taken = bm.num_free_blocks - 20 + evicted  # the fresh blocks (all but A's 20 cached ones) and more
    bm.allocate(make_seq("filler", seq_range(1000, taken // 2 * BS)))
    bm.free("filler")
    b = make_seq("b", seq_range(0, 44))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == hit_blocks * BS
    full, windowed = bm.block_tables("b")
    released = max(0, hit_blocks * BS - 8 + 1) // BS
    assert NULL_BLOCK not in full and windowed[:released] == [NULL_BLOCK] * released
    bm.check_integrity()


def test_a_block_of_one_group_never_serves_another():
    """Groups hold different layers: the same tokens cached by the full group are no hit for a
    manager asking the windowed group, and a corrupted table mixing them is caught."""
    bm = BlockManager(48, BS, windows=HYBRID)
    cached(bm, "a", seq_range(0, 40))
    b = make_seq("b", seq_range(0, 44))
    bm.allocate(b)
    full_a, _ = bm.block_tables("a")
    full_b, windowed_b = bm.block_tables("b")
    assert full_b[:10] == full_a and not set(windowed_b) & set(full_a)
    bm.check_integrity()
    windowed_b[9] = full_a[9]  # corrupt: a full-group block in a windowed table
    with pytest.raises(RuntimeError, match="group"):
        bm.check_integrity()


def test_the_prefix_delta_names_the_full_group_s_blocks_only():
    bm = BlockManager(48, BS, windows=HYBRID)
    cached(bm, "a", seq_range(0, 40))
    added, removed = bm.take_prefix_delta()
    assert len(added) == 10 and removed == ()
    assert bm.take_prefix_snapshot() == added
