"""Prefix caching in `splitserve.engine.block_manager.BlockManager` (pure Python, CPU only):
which computed full blocks are shared, when a hit is lost, and that a block is only ever shared
after the very same token prefix."""
from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from tests.engine.block_helpers import BS, cached, compute_all, make_seq, seq_range


# ---------------------------------------------------------------------------------------------
# prefix caching
# ---------------------------------------------------------------------------------------------

def test_prefix_hit_shares_computed_full_blocks():
    bm = BlockManager(16, block_size=BS)
    prefix = seq_range(0, 8)  # 2 full blocks
    cached(bm, "a", prefix + [100, 101])

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
    a = cached(bm, "a", seq_range(0, 9))
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
    cached(bm, "a", prompt)
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
    cached(bm, "a", seq_range(0, 9))

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
    cached(bm, "a", x + y + [0])
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
    cached(bm, "a", prompt)
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
    cached(bm, "a", seq_range(0, 9))  # 3 blocks
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
    cached(bm, "a", seq_range(0, 5))  # blocks [0, 1]; block 0 gets hashed
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
    cached(bm, "a", seq_range(0, 9))  # blocks 0,1,2; blocks 0,1 hashed
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
    cached(bm, "a", seq_range(0, 5))
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
    cached(bm, "a", prompt)
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
    cached(bm, "a", seq_range(0, 9))
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
