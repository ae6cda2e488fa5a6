"""Tests for `splitserve.engine.block_manager.BlockManager` (pure Python, CPU only): allocate /
grow / free accounting, export / import, and `check_integrity`.

Private attributes of the block manager are touched only to *corrupt* its state in the
`check_integrity` tests; every other check goes through the public API. Prefix caching is in
test_prefix_cache.py, the randomized engine simulation in test_block_manager_stress.py.
"""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.sequence import Sequence
from tests.engine.block_helpers import BS, cached, make_seq, seq_range


# ---------------------------------------------------------------------------------------------
# construction, allocate / grow / free accounting
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (-1, 4)])
def test_constructor_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_blocks_for():
    bm = BlockManager(8, block_size=4)
    assert [bm.blocks_for(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_allocate_grow_free_accounting():
    bm = BlockManager(10, block_size=BS)
    assert bm.num_blocks == 10 and bm.num_free_blocks == 10 and bm.num_used_blocks == 0

    a = make_seq("a", seq_range(0, 5))  # 2 blocks
    bm.allocate(a)
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0
    assert bm.has_blocks("a")
    assert len(bm.block_table("a")) == bm.blocks_for(5) == 2
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 2

    b = make_seq("b", seq_range(100, 4))  # exactly one block
    bm.allocate(b)
    assert len(bm.block_table("b")) == 1
    assert bm.num_free_blocks == 7
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.check_integrity()

    # growing within the current blocks is a no-op
    bm.grow(a, 8)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 7
    # growing past the boundary adds blocks, existing ids kept in order
    before = list(bm.block_table("a"))
    bm.grow(a, 9)
    assert bm.block_table("a")[:2] == before and len(bm.block_table("a")) == 3
    assert bm.num_free_blocks == 6
    bm.grow(a, 17)
    assert len(bm.block_table("a")) == 5 and bm.num_free_blocks == 4
    # grow never shrinks
    bm.grow(a, 1)
    assert len(bm.block_table("a")) == 5

    # decode-style growth: append a token then grow to num_tokens
    b.num_computed_tokens = 4
    b.append_token(7)
    bm.grow(b, b.num_tokens)
    assert len(bm.block_table("b")) == 2 and bm.num_free_blocks == 3
    bm.check_integrity()

    bm.free("a")
    assert not bm.has_blocks("a")
    assert bm.num_free_blocks == 8
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    bm.check_integrity()


def test_free_unknown_or_twice_is_a_noop():
    bm = BlockManager(4, block_size=BS)
    bm.free("nobody")
    a = make_seq("a", seq_range(0, 6))
    bm.allocate(a)
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_allocate_twice_raises():
    bm = BlockManager(4, block_size=BS)
    a = make_seq("a", seq_range(0, 3))
    bm.allocate(a)
    with pytest.raises(ValueError):
        bm.allocate(a)
    assert len(bm.block_table("a")) == 1 and bm.num_free_blocks == 3
    bm.check_integrity()


def test_allocate_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(3, block_size=BS)
    a = make_seq("a", seq_range(0, 9))  # needs 3 blocks
    b = make_seq("b", seq_range(50, 13))  # needs 4 blocks > 3
    assert not bm.can_allocate(b)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(b)
    assert not bm.has_blocks("b") and bm.num_free_blocks == 3
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert bm.num_free_blocks == 0
    c = make_seq("c", [99])
    assert not bm.can_allocate(c)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(c)
    assert not bm.has_blocks("c")
    bm.check_integrity()
    bm.free("a")
    assert bm.can_allocate(c)
    bm.allocate(c)
    bm.check_integrity()


def test_can_allocate_reserve_blocks_watermark():
    bm = BlockManager(5, block_size=BS)
    a = make_seq("a", seq_range(0, 12))  # 3 blocks
    assert bm.can_allocate(a, reserve_blocks=2)
    assert not bm.can_allocate(a, reserve_blocks=3)
    assert bm.can_allocate(a, reserve_blocks=0)


def test_grow_out_of_blocks_and_can_grow_agree():
    bm = BlockManager(4, block_size=BS)
    a = make_seq("a", seq_range(0, 4))
    b = make_seq("b", seq_range(10, 8))
    bm.allocate(a)
    bm.allocate(b)
    assert bm.num_free_blocks == 1
    for n in range(1, 20):
        ok = bm.can_grow(a, n)
        assert ok == (bm.blocks_for(n) - 1 <= 1), n
    assert bm.can_grow(a, 8)
    assert not bm.can_grow(a, 9)
    table = list(bm.block_table("a"))
    with pytest.raises(OutOfBlocksError):
        bm.grow(a, 9)
    # a failed grow takes nothing
    assert bm.block_table("a") == table and bm.num_free_blocks == 1
    bm.check_integrity()
    bm.grow(a, 8)
    assert bm.num_free_blocks == 0
    assert bm.can_grow(a, 8) and not bm.can_grow(a, 9)
    bm.check_integrity()


# ---------------------------------------------------------------------------------------------
# export / import
# ---------------------------------------------------------------------------------------------

def test_export_blocks_returns_table_in_order():
    bm = BlockManager(8, block_size=BS)
    x = make_seq("x", [9])
    bm.allocate(x)  # so that a's ids do not start at 0
    a = make_seq("a", seq_range(0, 10))
    bm.allocate(a)
    bm.grow(a, 13)
    [exported] = bm.export_blocks("a")
    assert exported == bm.block_table("a")
    assert len(exported) == 4
    # a copy: mutating it does not touch the manager
    exported.append(123)
    assert len(bm.block_table("a")) == 4
    with pytest.raises(KeyError):
        bm.export_blocks("nobody")


def test_reserve_for_import_allocates_fresh_blocks():
    bm = BlockManager(16, block_size=BS)
    prompt = seq_range(0, 9)
    cached(bm, "a", prompt)
    hits_before = bm.num_cache_hit_blocks

    b = make_seq("b", prompt + [77])
    free_before = bm.num_free_blocks
    [ids] = bm.reserve_for_import(b)
    assert [ids] == [bm.block_table("b")] == bm.export_blocks("b")
    assert len(ids) == bm.blocks_for(b.num_tokens)
    assert not set(ids) & set(bm.block_table("a"))
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert bm.num_free_blocks == free_before - len(ids)
    assert bm.num_cache_hit_blocks == hits_before
    bm.check_integrity()

    # the returned list is a copy
    ids.append(999)
    assert len(bm.block_table("b")) == bm.blocks_for(b.num_tokens)

    with pytest.raises(OutOfBlocksError):
        bm.reserve_for_import(make_seq("big", seq_range(0, 16 * BS)))
    assert not bm.has_blocks("big")
    bm.check_integrity()


# ---------------------------------------------------------------------------------------------
# check_integrity detects corruption (private attributes touched only to corrupt)
# ---------------------------------------------------------------------------------------------

def _populated() -> tuple[BlockManager, Sequence, Sequence]:
    bm = BlockManager(8, block_size=BS)
    a = cached(bm, "a", seq_range(0, 9))
    b = make_seq("b", seq_range(0, 9) + [5])
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    bm.check_integrity()
    return bm, a, b


def test_check_integrity_ref_count_bumped():
    bm, a, _ = _populated()
    bm._pool.hashed[bm.block_table("a")[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="ref_count"):
        bm.check_integrity()


def test_check_integrity_ref_count_dropped_on_shared_block():
    bm, a, _ = _populated()
    bm._pool.hashed[bm.block_table("a")[0]].ref_count -= 1
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_used_block_on_free_list():
    bm, a, _ = _populated()
    bm._pool.fresh.append(bm.block_table("a")[2])
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_free_block_missing_from_free_list():
    bm, _, _ = _populated()
    used = set(bm.block_table("a")) | set(bm.block_table("b"))
    free_id = next(i for i in range(bm.num_blocks) if i not in used)
    bm._pool.fresh.remove(free_id)
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_block_twice_in_a_table():
    bm, _, _ = _populated()
    table = bm.block_table("a")
    table.append(table[0])
    bm._pool.hashed[table[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="twice"):
        bm.check_integrity()


def test_check_integrity_shared_unhashed_block():
    bm, _, _ = _populated()
    victim = bm.block_table("a")[2]  # unhashed, held by a only
    bm.block_table("b").append(victim)
    with pytest.raises(RuntimeError, match="shared"):
        bm.check_integrity()


def test_check_integrity_stale_cache_entry():
    bm, a, _ = _populated()
    block = bm._pool.hashed[bm.block_table("a")[0]]
    block.key = (None, (123, 456, 789, 0))  # the cache entry now points at other content
    with pytest.raises(RuntimeError, match="cache"):
        bm.check_integrity()

