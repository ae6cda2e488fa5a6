"""`BlockManager.reserve_for_import` through the prefix cache (pure Python, CPU only): an import
shares the cached full blocks of its prompt's prefix, holds them until it ends, and leaves the
rest (at least the last token) for the transfer to write; a windowed layer group reserves only
what the first decode reaches."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK, BlockManager, OutOfBlocksError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence
from tests.engine.block_helpers import BS, cached, compute_all, make_seq, seq_range

TURN_1 = seq_range(0, 10)  # two full blocks and a half
TURN_2 = TURN_1 + seq_range(100, 7)


def test_import_shares_the_cached_prefix_and_reserves_fresh_blocks_for_the_rest():
    bm = BlockManager(16, block_size=BS)
    cached(bm, "a", TURN_1)
    free_before = bm.num_free_blocks
    b = make_seq("b", TURN_2)
    [ids] = bm.reserve_for_import(b, reuse_prefix=True)
    assert ids == bm.block_table("b") and len(ids) == bm.blocks_for(b.num_tokens)
    assert ids[:2] == bm.block_table("a")[:2] and not set(ids[2:]) & set(bm.block_table("a"))
    assert b.num_computed_tokens == b.num_cached_tokens == 2 * BS
    assert bm.num_free_blocks == free_before - (len(ids) - 2)
    assert bm.num_cache_hit_blocks == 2
    bm.check_integrity()  # ref counts: the shared blocks are held by both tables


def test_without_reuse_every_block_is_fresh():
    bm = BlockManager(16, block_size=BS)
    cached(bm, "a", TURN_1)
    b = make_seq("b", TURN_2)
    [ids] = bm.reserve_for_import(b)
    assert not set(ids) & set(bm.block_table("a"))
    assert b.num_computed_tokens == b.num_cached_tokens == 0 and bm.num_cache_hit_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("enable_prefix_caching, needs_prompt_logits", [(False, False), (True, True)])
def test_no_reuse_where_the_prefix_cache_would_not_be_used(enable_prefix_caching, needs_prompt_logits):
    bm = BlockManager(16, block_size=BS, enable_prefix_caching=enable_prefix_caching)
    cached(bm, "a", TURN_1)
    b = Sequence("b", TURN_2, SamplingParams(prompt_logprobs=1 if needs_prompt_logits else None))
    bm.reserve_for_import(b, reuse_prefix=True)
    assert b.num_computed_tokens == 0 and not set(bm.block_table("b")) & set(bm.block_table("a"))
    bm.check_integrity()


def test_the_last_prompt_token_is_always_transferred():
    bm = BlockManager(16, block_size=BS)
    cached(bm, "a", seq_range(0, 2 * BS))
    b = make_seq("b", seq_range(0, 2 * BS))  # the same block-aligned prompt
    bm.reserve_for_import(b, reuse_prefix=True)
    assert b.num_computed_tokens == BS  # its second block holds the last token: it travels
    bm.check_integrity()


def test_shared_blocks_are_held_so_no_allocation_evicts_them_meanwhile():
    bm = BlockManager(8, block_size=BS)
    a = cached(bm, "a", TURN_1)
    b = make_seq("b", TURN_2)
    [ids] = bm.reserve_for_import(b, reuse_prefix=True)  # 2 shared + 3 fresh
    bm.free(a.seq_id)  # the turn that cached the prefix ends: only the import holds it now
    filler = make_seq("filler", seq_range(500, bm.num_free_blocks * BS))
    bm.allocate(filler)  # every free block, evicting whatever cached content is not held
    assert bm.num_free_blocks == 0 and bm.block_table("b") == ids
    assert not set(ids) & set(bm.block_table("filler"))
    bm.check_integrity()


def test_an_import_that_does_not_fit_changes_nothing():
    bm = BlockManager(6, block_size=BS)
    a = cached(bm, "a", TURN_1)
    bm.free(a.seq_id)  # its two full blocks stay cached but free: reviving them costs free blocks
    b = make_seq("b", TURN_1 + seq_range(100, 3 * BS))  # 2 cached (free) + 4 fresh blocks: 6 free needed
    other = make_seq("other", seq_range(900, 1))
    bm.allocate(other)
    with pytest.raises(OutOfBlocksError):
        bm.reserve_for_import(b, reuse_prefix=True)
    assert not bm.has_blocks("b") and bm.num_free_blocks == 5
    bm.check_integrity()


@pytest.mark.parametrize("completed", [True, False], ids=["completed", "aborted"])
def test_ending_a_partial_import_releases_its_blocks_and_keeps_the_prefix_cached(completed):
    bm = BlockManager(16, block_size=BS)
    a = cached(bm, "a", TURN_1)
    b = make_seq("b", TURN_2)
    bm.reserve_for_import(b, reuse_prefix=True)
    if completed:  # the KV landed: commit it, as `Policy.complete_import` does
        compute_all(bm, b)
    bm.free(b.seq_id)
    bm.free(a.seq_id)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()
    c = make_seq("c", TURN_2 + [7])
    bm.reserve_for_import(c, reuse_prefix=True)
    assert c.num_computed_tokens == (4 if completed else 2) * BS  # a completed import extends the cache
    bm.check_integrity()


def test_a_windowed_group_reserves_only_what_the_first_decode_reaches():
    """Beside a full group, a windowed table's leading entries out of the first decode's reach are
    NULL_BLOCK from the start, cached blocks among them are not taken, and completing the import
    releases nothing more; its blocks in reach are cached for a later prompt's hit."""
    bm = BlockManager(40, block_size=BS, windows=(None, 2 * BS))
    cached(bm, "a", seq_range(0, 6 * BS))  # full group: 6 blocks; windowed: blocks 4 and 5 (0-3 released, cached)
    b = make_seq("b", seq_range(0, 6 * BS) + seq_range(100, 3 * BS + 1))  # 10 blocks, the last holding one token
    free_before = bm.num_free_blocks
    full, windowed = bm.reserve_for_import(b, reuse_prefix=True)
    reach = (b.num_tokens - 2 * BS + 1) // BS  # the first decode, at position num_tokens, reads from block 7
    assert b.num_computed_tokens == 6 * BS and full[:6] == bm.block_table("a")[:6]
    assert windowed[:reach] == [NULL_BLOCK] * reach and NULL_BLOCK not in windowed[reach:] and len(windowed) == 10
    assert free_before - bm.num_free_blocks == 4 + (10 - reach)  # fresh: the full group's 4, the window's 3
    assert bm.held_from(b) == (6 * BS, reach * BS)  # the KV the import receives: after the hit, and in reach
    bm.check_integrity()
    compute_all(bm, b)  # the KV landed: `Policy.complete_import` commits it
    assert bm.block_tables("b") == [full, windowed] and free_before - bm.num_free_blocks == 4 + (10 - reach)
    bm.check_integrity()
    c = make_seq("c", b.token_ids + [7] * 3)
    bm.allocate(c)
    assert c.num_computed_tokens == 9 * BS  # the window's blocks 7 and 8 came from the import
    bm.check_integrity()


@pytest.mark.parametrize("max_tokens, others, needed", [(3 * BS, 0, 10 + 2 + 3), (3 * BS, 2, 10 + 2 + 5),
                                                        (25 * BS, 0, 10 + 10), (3 * BS, 6, 10 + 10)])
def test_a_windowed_import_is_admitted_with_room_for_the_full_groups_growth(max_tokens, others, needed):
    """40 tokens beside a 2-block window: it holds 10 + 2 blocks, and admission asks for its full
    group's growth over max_tokens (3 blocks) and the running sequences' (`others`) too, never more
    than the 8 it skips: no later than a whole reservation's 20."""
    for free in (needed - 1, needed):
        bm = BlockManager(free + 1, block_size=BS, windows=(None, 2 * BS))
        seq = make_seq("s", seq_range(0, 10 * BS), max_tokens=max_tokens)
        assert bm.full_growth(seq) == (max_tokens + BS - 1) // BS
        decodes = [make_seq("other", seq_range(900, BS), max_tokens=others * BS)] if others else []  # grows `others`
        if free < needed:
            with pytest.raises(OutOfBlocksError):
                bm.reserve_for_import(seq, others=decodes)
            assert not bm.has_blocks("s") and bm.num_free_blocks == free
        else:
            bm.reserve_for_import(seq, others=decodes)
            assert bm.num_free_blocks == free - 12
        bm.check_integrity()


def test_held_from_starts_past_the_prefix_hit_and_ends_at_the_last_token():
    """A hit past a window's reach starts that group at the hit too; a window of one token reaches
    only the block the first decode writes, and where that is past the prompt's blocks, the last
    token's KV still travels (into NULL_BLOCK: never read)."""
    bm = BlockManager(40, block_size=BS, windows=(None, 2 * BS, 1))
    cached(bm, "a", seq_range(0, 6 * BS))
    b = make_seq("b", seq_range(0, 6 * BS) + seq_range(100, BS // 2))
    bm.reserve_for_import(b, reuse_prefix=True)
    assert bm.held_from(b) == (6 * BS, 6 * BS, 6 * BS)
    c = make_seq("c", seq_range(200, 4 * BS))  # no hit, a whole number of blocks
    bm.reserve_for_import(c)
    assert bm.held_from(c) == (0, (4 * BS - 2 * BS + 1) // BS * BS, 4 * BS - 1)
