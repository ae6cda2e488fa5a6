"""Policies over a block manager with a windowed layer group (pure Python, no model): a prompt
the mixed or SLO-aware policy prefills takes its blocks chunk by chunk, a promise that falls
short preempts it, and a switch to a whole-prompt policy takes the rest of its blocks or preempts
it; a token worker's windowed imports wait for room for the running decodes' growth. Driven as in
test_policies.py."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.policies import SchedulerLimits, make_policy
from splitserve.engine.policies.plan import SLOOptions
from tests.engine.policy_helpers import BS, complete, import_seq, make_seq, shape, step


def windowed(name: str, num_blocks: int, window: int, **limits):
    """A policy over a block manager whose one layer group has a window."""
    return make_policy(name, BlockManager(num_blocks, BS, windows=(window,)), SchedulerLimits(**limits))


@pytest.mark.parametrize("name", ["mixed", "accelgen"])
def test_a_windowed_prompt_longer_than_the_cache_is_prefilled_chunk_by_chunk(name):
    """Admitted by the blocks its chunks and window hold at once, not its whole length, and those
    blocks are taken chunk by chunk; its decodes then hold about a window's."""
    p = windowed(name, 9, 2 * BS, chunk_token_budget=BS, slo=SLOOptions(max_budget_tokens=BS, tile_tokens=BS))
    a, short = make_seq("a", 15 * BS, max_tokens=20), make_seq("short", 3, start=500, max_tokens=20)
    p.add(a)
    p.add(short)
    while p.has_work():
        plan = p.schedule()
        for item in plan.scheduled:  # a chunk's blocks, no more; a decode's, about a window's
            table = p.blocks.block_table(item.seq.seq_id)
            if item.seq.is_decoding:
                assert p.blocks.num_held_blocks(item.seq.seq_id) <= 2 + 2  # window / BS + 2
            else:
                assert len(table) == p.blocks.blocks_for(item.start + item.num_new_tokens)
        complete(p, plan)
    assert a.num_output_tokens == short.num_output_tokens == 20 and p.num_preemptions == 0


def test_a_windowed_prompt_whose_promise_falls_short_is_preempted_and_recomputed_later():
    """Its prefix hit shares a windowed block with a prefilled hand-off; releasing that block
    frees nothing, and with no other block free its next chunk cannot grow: it is preempted."""
    p = windowed("mixed", 8, BS, chunk_token_budget=BS + 1)
    holder = make_seq("holder", 2 * BS)
    filler = make_seq("filler", 3 * BS, start=500)
    p.add(holder, hand_off=True)
    p.add(filler, hand_off=True)
    a = make_seq("a", 8 * BS)
    p.add(a)
    while a.num_computed_tokens <= 2 * BS:
        plan, _ = step(p)
    assert set(p.held) == {"holder", "filler"} and p.blocks.num_free_blocks == 0
    preempted = []
    while not preempted:
        plan, _ = step(p)
        preempted = plan.preempted
    assert preempted == (a,) and list(p.waiting) == [a] and a.num_computed_tokens == 0
    p.finish(holder, "exported")
    p.finish(filler, "exported")
    while p.has_work():
        step(p)
    assert a.num_output_tokens == a.params.max_tokens


def test_a_switch_to_a_whole_prompt_policy_takes_a_chunked_prompts_blocks_or_preempts_it():
    for fits in (True, False):
        mixed = windowed("mixed", 20, 2 * BS, chunk_token_budget=BS)  # 19 blocks
        if not fits:  # a prefilled hand-off holds 11 of them
            mixed.add(make_seq("b", 11 * BS, start=500), hand_off=True)
            while mixed.running or mixed.waiting:
                step(mixed)
        a = make_seq("a", 12 * BS)
        mixed.add(a)
        step(mixed)
        orca = make_policy("orca", mixed.blocks, mixed.limits)
        orca.adopt(mixed)
        orca.blocks.check_integrity()
        if fits:
            assert len(orca.blocks.block_table("a")) == 12 and orca.running == [a]
            plan, _ = step(orca)
            assert shape(plan) == [("a", 11 * BS)]
        else:
            assert a in orca.waiting and a.num_computed_tokens == 0 and orca.num_preemptions == 1


def test_a_token_worker_admits_a_windowed_import_with_room_for_the_other_decodes_growth():
    """Beside a full layer group, an import reserves 10 + 2 blocks; the other one's full group
    still grows by 8 blocks to its max_tokens, importing or decoding, so the next import waits
    though its 12 (and its own growth, 1) would fit; once that decode ends, it is taken."""
    p = make_policy("token", BlockManager(32, BS, windows=(None, 2 * BS)), SchedulerLimits())
    a = make_seq("a", 10 * BS, max_tokens=8 * BS)
    p.reserve_import(a)
    assert p.blocks.num_free_blocks == 31 - 12
    b = make_seq("b", 10 * BS, start=500, max_tokens=BS)
    for _ in ("importing", "decoding"):
        with pytest.raises(OutOfBlocksError):
            p.reserve_import(b)
        assert not p.blocks.has_blocks("b")
        if a.seq_id in p.held:
            a = p.complete_import(a.seq_id, 7)
    p.finish(a, "stop")
    import_seq(p, b)
    assert p.blocks.num_free_blocks == 31 - 12
