"""Tests for `splitserve.engine.block_manager.BlockManager` (pure Python, CPU only).

Private attributes of the block manager are touched only to *corrupt* its state in the
`check_integrity` tests; every other check goes through the public API.

The stress test simulates an engine on top of the block manager and also simulates the KV cache
itself: every slot written by a "step" (or an import transfer) records an id of the *whole token
prefix* up to and including that position (the KV of a token depends on every token before it).
After each operation, every computed position of every running sequence must read back its own
prefix id from its block table. That catches any wrong sharing, including sharing a block whose
tokens match but whose preceding context differs.
"""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

BS = 4


def make_seq(seq_id: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=max_tokens))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a step computed every token of `seq`, then commit."""
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def seq_range(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


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
# prefix caching
# ---------------------------------------------------------------------------------------------

def test_prefix_hit_shares_computed_full_blocks():
    bm = BlockManager(16, block_size=BS)
    prefix = seq_range(0, 8)  # 2 full blocks
    a = make_seq("a", prefix + [100, 101])
    bm.allocate(a)
    compute_all(bm, a)

    b = make_seq("b", prefix + [200, 201, 202])
    assert bm.can_allocate(b)
    free_before = bm.num_free_blocks
    bm.allocate(b)
    assert b.num_computed_tokens == 2 * BS
    assert b.num_cached_tokens == 2 * BS
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] not in bm.block_table("a")
    assert len(bm.block_table("b")) == bm.blocks_for(b.num_tokens)
    # only the non-shared block came from the free list
    assert bm.num_free_blocks == free_before - 1
    assert bm.num_cache_hit_blocks == 2
    bm.check_integrity()

    # freeing the holder of a shared block keeps it alive for the other
    shared = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.block_table("b")[:2] == shared
    assert bm.num_free_blocks == 16 - 3
    bm.check_integrity()


def test_only_computed_blocks_are_cached():
    bm = BlockManager(16, block_size=BS)
    prefix = seq_range(0, 8)
    a = make_seq("a", prefix + [100])
    bm.allocate(a)
    # allocated but not computed / committed: nothing to hit
    b = make_seq("b", prefix + [200])
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))

    # a computes 6 tokens (one full block + half of the next) and commits
    bm.grow(a, 6)
    a.num_computed_tokens = 6
    bm.commit(a)
    c = make_seq("c", prefix + [300])
    bm.allocate(c)
    assert c.num_computed_tokens == BS
    assert bm.block_table("c")[0] == bm.block_table("a")[0]
    assert bm.block_table("c")[1] != bm.block_table("a")[1]

    # computing without commit does not publish the block
    a.num_computed_tokens = 9
    d = make_seq("d", prefix + [400])
    bm.allocate(d)
    assert d.num_computed_tokens == BS
    bm.commit(a)
    e = make_seq("e", prefix + [500])
    bm.allocate(e)
    assert e.num_computed_tokens == 2 * BS
    assert bm.block_table("e")[:2] == bm.block_table("a")[:2]
    bm.check_integrity()


def test_commit_is_idempotent():
    bm = BlockManager(8, block_size=BS)
    a = make_seq("a", seq_range(0, 9))
    bm.allocate(a)
    compute_all(bm, a)
    bm.commit(a)
    bm.commit(a)
    bm.check_integrity()
    b = make_seq("b", seq_range(0, 9))
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    bm.check_integrity()


def test_block_aligned_identical_prompt_still_computes_a_token():
    bm = BlockManager(16, block_size=BS)
    prompt = seq_range(0, 3 * BS)
    a = make_seq("a", prompt)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq("b", prompt)
    bm.allocate(b)
    # the block holding the last token is never a hit
    assert b.num_computed_tokens == 2 * BS
    assert b.num_uncomputed_tokens >= 1
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    bm.check_integrity()

    # single-block prompt: no hit at all
    c = make_seq("c", seq_range(0, BS))
    bm.allocate(c)
    assert c.num_computed_tokens == 0
    assert bm.block_table("c")[0] != bm.block_table("a")[0]
    # one token past the boundary: the full first block is a hit
    d = make_seq("d", seq_range(0, BS + 1))
    bm.allocate(d)
    assert d.num_computed_tokens == BS
    assert bm.block_table("d")[0] == bm.block_table("a")[0]
    bm.check_integrity()


def test_different_prefixes_do_not_hit():
    bm = BlockManager(16, block_size=BS)
    a = make_seq("a", seq_range(0, 9))
    bm.allocate(a)
    compute_all(bm, a)

    b = make_seq("b", seq_range(1, 9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))

    # same first block, diverges within the second
    c = make_seq("c", seq_range(0, 6) + [77, 78, 79])
    bm.allocate(c)
    assert c.num_computed_tokens == BS
    assert bm.block_table("c")[0] == bm.block_table("a")[0]
    assert bm.block_table("c")[1] != bm.block_table("a")[1]
    bm.check_integrity()


def test_same_block_content_after_different_prefix_does_not_hit():
    bm = BlockManager(16, block_size=BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_seq("a", x + y + [0])
    bm.allocate(a)
    compute_all(bm, a)
    # y at block 1 after a different block 0
    b = make_seq("b", z + y + [0])
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    # y at block 0
    c = make_seq("c", y + [0])
    bm.allocate(c)
    assert c.num_computed_tokens == 0
    assert bm.block_table("c")[0] not in bm.block_table("a")
    bm.check_integrity()


def test_hit_survives_free_and_preemption():
    bm = BlockManager(8, block_size=BS)
    prompt = seq_range(0, 10)
    a = make_seq("a", prompt)
    bm.allocate(a)
    compute_all(bm, a)
    table = list(bm.block_table("a"))
    bm.free("a")
    assert bm.num_free_blocks == 8

    # a new request with the same prefix takes the freed blocks back
    b = make_seq("b", prompt + [42])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 2 * BS
    assert bm.block_table("b")[:2] == table[:2]
    bm.check_integrity()

    # preemption: free + reset, then allocate again hits its own blocks
    b.num_computed_tokens = b.num_tokens
    bm.commit(b)
    b_table = list(bm.block_table("b"))
    bm.free("b")
    b.num_computed_tokens = 0
    bm.allocate(b)
    assert b.num_computed_tokens == 2 * BS  # 11 tokens: blocks 0 and 1 (block 2 holds the last token)
    assert bm.block_table("b")[:2] == b_table[:2]
    bm.check_integrity()


def test_revived_blocks_count_against_free_blocks_and_in_use_hits_do_not():
    bm = BlockManager(4, block_size=BS)
    a = make_seq("a", seq_range(0, 9))  # 3 blocks
    bm.allocate(a)
    compute_all(bm, a)
    # a is alive: b's two hits are in use, so b needs only its one fresh block
    b = make_seq("b", seq_range(0, 9))
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 4
    # everything free: c = 3 blocks, two of them revived from the free list, needs 3 free
    c = make_seq("c", seq_range(0, 9))
    assert bm.can_allocate(c)
    assert not bm.can_allocate(c, reserve_blocks=2)
    bm.allocate(c)
    assert c.num_computed_tokens == 8
    assert bm.num_free_blocks == 1
    bm.check_integrity()


def test_revived_hit_is_not_evicted_by_the_same_allocation():
    bm = BlockManager(3, block_size=BS)
    a = make_seq("a", seq_range(0, 5))  # blocks [0, 1]; block 0 gets hashed
    bm.allocate(a)
    compute_all(bm, a)
    hashed = bm.block_table("a")[0]
    bm.free("a")
    # churn so that the hashed block becomes the least recently freed one
    for i in range(2):
        x = make_seq(f"x{i}", [1000 + i])
        bm.allocate(x)
        bm.free(f"x{i}")
    b = make_seq("b", seq_range(0, 5))
    bm.allocate(b)
    assert b.num_computed_tokens == BS
    assert bm.block_table("b")[0] == hashed
    assert bm.block_table("b")[1] != hashed
    bm.check_integrity()


def test_hit_lost_once_block_is_reused_lru():
    bm = BlockManager(4, block_size=BS)
    a = make_seq("a", seq_range(0, 9))  # blocks 0,1,2; blocks 0,1 hashed
    bm.allocate(a)
    compute_all(bm, a)
    t = list(bm.block_table("a"))
    bm.free("a")  # freed tail first: LRU order = never-used block, then t[2], t[1], t[0]

    taken = []
    for i in range(3):
        x = make_seq(f"x{i}", [500 + i])
        bm.allocate(x)
        taken.append(bm.block_table(f"x{i}")[0])
    # the never-used block goes first, then a's blocks tail first
    assert taken[1:] == [t[2], t[1]]
    bm.check_integrity()
    for i in range(3):
        bm.free(f"x{i}")

    # block t[1] was reused for other content: only the first block still hits
    b = make_seq("b", seq_range(0, 9))
    bm.allocate(b)
    assert b.num_computed_tokens == BS
    assert bm.block_table("b")[0] == t[0]
    bm.check_integrity()


def test_hit_lost_when_first_block_reused():
    bm = BlockManager(2, block_size=BS)
    a = make_seq("a", seq_range(0, 5))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free("a")
    x = make_seq("x", seq_range(100, 8))  # takes both blocks: new content
    bm.allocate(x)
    bm.free("x")
    b = make_seq("b", seq_range(0, 5))
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    bm.check_integrity()


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(16, block_size=BS, enable_prefix_caching=False)
    prompt = seq_range(0, 9)
    a = make_seq("a", prompt)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq("b", prompt)
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("a")
    c = make_seq("c", prompt)
    bm.allocate(c)
    assert c.num_computed_tokens == 0
    assert bm.num_cache_hit_blocks == 0
    bm.check_integrity()


def test_allocate_without_prefix_cache_argument():
    bm = BlockManager(16, block_size=BS)
    a = make_seq("a", seq_range(0, 9))
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq("b", seq_range(0, 9))
    bm.allocate(b, use_prefix_cache=False)
    assert b.num_computed_tokens == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.check_integrity()


def test_duplicate_block_keeps_parent_chain_on_later_commit():
    """Two sequences with the same prompt admitted before either commits compute the same blocks
    twice; the second's duplicates stay private. Its later blocks must still be keyed by the
    whole prefix before them, never as first blocks, or a request starting with those tokens
    would reuse KV computed after a different prefix."""
    bm = BlockManager(16, block_size=BS)
    p, x = [1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13]
    a = make_seq("a", p + [50])
    b = make_seq("b", p + x + [99])
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: no hit, fresh blocks
    assert b.num_computed_tokens == 0
    compute_all(bm, a)  # p's two blocks hashed through a

    # b: chunked prefill, first chunk = p (its copies of p's blocks are duplicates)
    b.num_computed_tokens = 8
    bm.commit(b)
    # second chunk: x
    b.num_computed_tokens = 12
    bm.commit(b)
    bm.check_integrity()

    c = make_seq("c", x + [7])  # x at position 0: must not hit b's block holding x at 8..11
    bm.allocate(c)
    assert c.num_computed_tokens == 0, (
        f"c hit block {bm.block_table('c')[0]} which is b's block 2 ({bm.block_table('b')[2]})")


def test_duplicate_block_keeps_parent_chain_in_decode():
    """As above, through plain decode: two identical prompts admitted in one batch."""
    bm = BlockManager(16, block_size=BS)
    prompt = [1, 2, 3, 4, 5]
    a = make_seq("a", prompt)
    b = make_seq("b", prompt)
    bm.allocate(a)
    bm.allocate(b)
    for s in (a, b):  # one prefill step each, then commit
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    # b decodes 4 tokens; its second block [5, 20, 21, 22] fills and is committed
    for tok in (20, 21, 22, 23):
        b.append_token(tok)
        bm.grow(b, b.num_tokens)
        b.num_computed_tokens = b.num_tokens - 1
        bm.commit(b)
    b.num_computed_tokens = b.num_tokens
    bm.commit(b)
    bm.check_integrity()
    c = make_seq("c", [5, 20, 21, 22, 0])
    bm.allocate(c)
    assert c.num_computed_tokens == 0


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
    exported = bm.export_blocks("a")
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
    a = make_seq("a", prompt)
    bm.allocate(a)
    compute_all(bm, a)
    hits_before = bm.num_cache_hit_blocks

    b = make_seq("b", prompt + [77])
    free_before = bm.num_free_blocks
    ids = bm.reserve_for_import(b)
    assert ids == bm.block_table("b") == bm.export_blocks("b")
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
    a = make_seq("a", seq_range(0, 9))
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq("b", seq_range(0, 9) + [5])
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    bm.check_integrity()
    return bm, a, b


def test_check_integrity_ref_count_bumped():
    bm, a, _ = _populated()
    bm._blocks[bm.block_table("a")[2]].ref_count += 1
    with pytest.raises(RuntimeError, match="ref_count"):
        bm.check_integrity()


def test_check_integrity_ref_count_dropped_on_shared_block():
    bm, a, _ = _populated()
    bm._blocks[bm.block_table("a")[0]].ref_count -= 1
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_used_block_on_free_list():
    bm, a, _ = _populated()
    bm._free[bm.block_table("a")[2]] = None
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_free_block_missing_from_free_list():
    bm, _, _ = _populated()
    used = set(bm.block_table("a")) | set(bm.block_table("b"))
    free_id = next(i for i in range(bm.num_blocks) if i not in used)
    del bm._free[free_id]
    with pytest.raises(RuntimeError):
        bm.check_integrity()


def test_check_integrity_block_twice_in_a_table():
    bm, _, _ = _populated()
    table = bm._tables["a"]
    table.append(table[0])
    bm._blocks[table[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="twice"):
        bm.check_integrity()


def test_check_integrity_shared_unhashed_block():
    bm, _, _ = _populated()
    victim = bm.block_table("a")[2]  # unhashed, held by a only
    bm._tables["b"].append(victim)
    bm._blocks[victim].ref_count += 1
    with pytest.raises(RuntimeError, match="shared"):
        bm.check_integrity()


def test_check_integrity_stale_cache_entry():
    bm, a, _ = _populated()
    block = bm._blocks[bm.block_table("a")[0]]
    block.key = (None, (123, 456, 789, 0))  # the cache entry now points at other content
    with pytest.raises(RuntimeError, match="cache"):
        bm.check_integrity()


# ---------------------------------------------------------------------------------------------
# randomized engine simulation
# ---------------------------------------------------------------------------------------------

class _KVSim:
    """A fake KV cache: each slot holds the id of the token prefix whose last token it encodes."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self._ids: dict[tuple[int, int], int] = {}

    def prefix_ids(self, tokens: list[int]) -> list[int]:
        out, prev = [], -1
        for t in tokens:
            prev = self._ids.setdefault((prev, t), len(self._ids))
            out.append(prev)
        return out

    def write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        ids = self.prefix_ids(tokens[:end])
        for p in range(start, end):
            self.slots[table[p // self.bs]][p % self.bs] = ids[p]

    def check(self, seq: Sequence, table: list[int]) -> None:
        ids = self.prefix_ids(seq.token_ids[:seq.num_computed_tokens])
        for p, want in enumerate(ids):
            got = self.slots[table[p // self.bs]][p % self.bs]
            assert got == want, (
                f"{seq.seq_id}: KV at position {p} (block {table[p // self.bs]}) was computed for "
                f"another prefix; computed={seq.num_computed_tokens} tokens={seq.token_ids}")


def _run_engine_sim(seed: int, num_ops: int, enable_prefix_caching: bool = True,
                    num_blocks: int = 24, block_size: int = BS) -> dict:
    rng = random.Random(seed)
    bs = block_size
    bm = BlockManager(num_blocks, block_size=bs, enable_prefix_caching=enable_prefix_caching)
    kv = _KVSim(num_blocks, bs)
    # block-sized chunks, shared across prompts at various positions, plus shared prefixes
    chunks = [[rng.randrange(8) for _ in range(bs)] for _ in range(5)]
    prefixes = [[t for _ in range(k) for t in rng.choice(chunks)] for k in (1, 2, 2, 3)]

    waiting: list[Sequence] = []
    running: list[Sequence] = []  # admission order: the youngest is last
    counter = 0
    stats = dict(admitted=0, hits=0, hit_tokens=0, preempted=0, finished=0, imported=0, steps=0,
                 shared_seen=0, out_of_blocks_admit=0)

    def new_seq() -> Sequence:
        nonlocal counter
        counter += 1
        tokens = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        for _ in range(rng.randrange(3)):
            tokens += rng.choice(chunks)
        tokens += [rng.randrange(8) for _ in range(rng.randrange(bs + 1))]
        if not tokens:
            tokens = [rng.randrange(8)]
        tokens = tokens[: (num_blocks // 2) * bs]
        return make_seq(f"s{seed}-{counter}", tokens, max_tokens=rng.randint(1, 3 * bs))

    def preempt(seq: Sequence) -> None:
        bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        running.remove(seq)
        waiting.insert(0, seq)
        stats["preempted"] += 1

    def finish(seq: Sequence) -> None:
        bm.free(seq.seq_id)
        running.remove(seq)
        stats["finished"] += 1

    def grow_or_preempt(seq: Sequence, num_tokens: int) -> bool:
        """grow(seq), preempting the youngest running sequence while short. False if `seq` itself
        got preempted."""
        while True:
            can = bm.can_grow(seq, num_tokens)
            try:
                bm.grow(seq, num_tokens)
            except OutOfBlocksError:
                assert not can, "can_grow said yes but grow raised"
                victim = running[-1]
                preempt(victim)
                if victim is seq:
                    return False
                continue
            assert can, "can_grow said no but grow succeeded"
            assert len(bm.block_table(seq.seq_id)) >= bm.blocks_for(num_tokens)
            return True

    def admit(seq: Sequence) -> None:
        can = bm.can_allocate(seq)
        free_before = bm.num_free_blocks
        try:
            bm.allocate(seq)
        except OutOfBlocksError:
            assert not can, "can_allocate said yes but allocate raised"
            assert not bm.has_blocks(seq.seq_id) and bm.num_free_blocks == free_before
            stats["out_of_blocks_admit"] += 1
            return
        assert can, "can_allocate said no but allocate succeeded"
        waiting.remove(seq)
        running.append(seq)
        stats["admitted"] += 1
        n = seq.num_computed_tokens
        assert n == seq.num_cached_tokens
        assert n % bs == 0 and n < seq.num_tokens
        if not enable_prefix_caching:
            assert n == 0
        if n:
            stats["hits"] += 1
            stats["hit_tokens"] += n
        assert len(bm.block_table(seq.seq_id)) == bm.blocks_for(seq.num_tokens)

    def import_seq(seq: Sequence) -> None:
        seq.append_token(rng.randrange(8))  # the first token, sampled by the prefill instance
        if bm.blocks_for(seq.num_tokens) > bm.num_free_blocks:
            with pytest.raises(OutOfBlocksError):
                bm.reserve_for_import(seq)
            seq.token_ids.pop()
            assert not bm.has_blocks(seq.seq_id)
            return
        ids = bm.reserve_for_import(seq)
        assert seq.num_computed_tokens == 0
        assert ids == bm.block_table(seq.seq_id)
        others = {b for s in running for b in bm.block_table(s.seq_id)}
        assert not set(ids) & others, "reserve_for_import shared a block"
        waiting.remove(seq)
        running.append(seq)
        # the transfer writes the KV of every token but the new one
        kv.write(ids, seq.token_ids, 0, seq.num_tokens - 1)
        seq.num_computed_tokens = seq.num_tokens - 1
        bm.commit(seq)
        stats["imported"] += 1

    def step(seq: Sequence) -> None:
        stats["steps"] += 1
        c = seq.num_computed_tokens
        n = rng.randint(1, min(seq.num_uncomputed_tokens, 2 * bs + 1))
        if not grow_or_preempt(seq, c + n):
            return
        table = bm.block_table(seq.seq_id)
        for p in range(c, c + n):  # a write never lands on a block another table holds
            block = table[p // bs]
            holders = [s.seq_id for s in running if s is not seq and block in bm.block_table(s.seq_id)]
            assert not holders, f"{seq.seq_id} writes position {p} into block {block} shared with {holders}"
        kv.write(table, seq.token_ids, c, c + n)
        seq.num_computed_tokens = c + n
        bm.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:  # sampled a token
            seq.append_token(rng.randrange(8))
            if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.03:
                finish(seq)
                return
            grow_or_preempt(seq, seq.num_tokens)

    def check_all() -> None:
        bm.check_integrity()
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        used = set()
        for s in running:
            table = bm.block_table(s.seq_id)
            assert len(table) == bm.blocks_for(s.num_tokens)
            assert 0 <= s.num_computed_tokens < s.num_tokens
            kv.check(s, table)
            for i, b in enumerate(table):
                holders.setdefault(b, []).append((s, i))
                used.add(b)
        for s in waiting:
            assert not bm.has_blocks(s.seq_id) and s.num_computed_tokens == 0
        assert bm.num_used_blocks == len(used)
        assert bm.num_free_blocks == num_blocks - len(used)
        for b, hs in holders.items():
            if len(hs) < 2:
                continue
            stats["shared_seen"] += 1
            assert enable_prefix_caching, f"block {b} shared with prefix caching disabled"
            s0, i0 = hs[0]
            for s, i in hs[1:]:
                assert i == i0, f"block {b} is block {i0} of {s0.seq_id} but block {i} of {s.seq_id}"
                end = (i + 1) * bs
                assert end <= s0.num_computed_tokens and end <= s.num_computed_tokens, (
                    f"shared block {b} not fully computed in both {s0.seq_id} and {s.seq_id}")
                assert s.token_ids[i * bs:end] == s0.token_ids[i * bs:end]
                assert s.token_ids[:end] == s0.token_ids[:end], (
                    f"shared block {b} follows different prefixes in {s0.seq_id} and {s.seq_id}")

    for op in range(num_ops):
        r = rng.random()
        if r < 0.12 or not (waiting or running):
            waiting.append(new_seq())
        elif r < 0.35 and waiting:
            admit(rng.choice(waiting[:3]))
        elif r < 0.40 and waiting:
            import_seq(rng.choice(waiting))
        elif r < 0.93 and running:
            step(rng.choice(running))
        elif r < 0.96 and running:
            finish(rng.choice(running))
        elif running:
            preempt(rng.choice(running))
        check_all()

    for s in list(running):
        finish(s)
        bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == 0
    bm.check_integrity()
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_simulation_stress(seed):
    stats = _run_engine_sim(seed, 3000)
    # the simulation must actually exercise the interesting paths
    assert stats["hits"] > 20, stats
    assert stats["preempted"] > 5, stats
    assert stats["shared_seen"] > 20, stats
    assert stats["finished"] > 20, stats
    assert stats["imported"] > 5, stats


def test_engine_simulation_stress_no_prefix_caching():
    stats = _run_engine_sim(7, 1500, enable_prefix_caching=False)
    assert stats["hits"] == 0 and stats["shared_seen"] == 0
    assert stats["preempted"] > 5 and stats["finished"] > 20, stats
