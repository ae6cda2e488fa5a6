"""A sequence's life under a scheduling policy (pure Python, no model): `complete_step`
bookkeeping, stop conditions, finish / abort, and KV import for the token role."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import SchedulerLimits
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.policies.token import TokenPolicy
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence, SequenceStatus
from tests.engine.policy_helpers import EOS, complete, import_seq, make, make_seq, shape, step


# ---------------------------------------------------------------------------------------------
# complete_step: computed tokens, stop conditions, finish
# ---------------------------------------------------------------------------------------------

def run_one(tokens: list[int], prompt_len: int = 4, max_model_len: int = 2048, **params) -> Sequence:
    """Feed `tokens` to one sequence until it finishes (or the tokens run out)."""
    p = make("mixed", max_model_len=max_model_len)
    seq = make_seq("s", prompt_len, **params)
    p.add(seq)
    for tok in tokens:
        step(p, token=tok)
        if seq.is_finished:
            break
    if seq.is_finished:
        assert not p.blocks.has_blocks("s") and p.blocks.num_free_blocks == p.blocks.num_blocks
        assert not p.has_work()
    return seq


def test_complete_step_advances_computed_tokens_per_chunk():
    p = make("mixed", chunk_token_budget=4)
    s = make_seq("s", 10)
    p.add(s)
    _, updated = step(p)
    assert s.num_computed_tokens == 4 and updated == [] and s.num_tokens == 10
    _, updated = step(p)
    assert s.num_computed_tokens == 8 and updated == []
    _, updated = step(p, token=5)
    assert s.num_computed_tokens == 10 and updated == [s] and s.token_ids[-1] == 5
    _, updated = step(p, token=6)
    assert s.num_computed_tokens == 11 and s.output_token_ids == [5, 6]


def test_stop_max_tokens_is_length():
    s = run_one([1, 2, 3, 4, 5], max_tokens=3)
    assert s.output_token_ids == [1, 2, 3] and s.finish_reason == "length" and s.is_finished


def test_stop_eos_is_stop_unless_ignore_eos():
    s = run_one([1, EOS, 3], max_tokens=10)
    assert s.output_token_ids == [1, EOS] and s.finish_reason == "stop"
    s = run_one([1, EOS, 3], max_tokens=3, ignore_eos=True)
    assert s.output_token_ids == [1, EOS, 3] and s.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    s = run_one([1, 42, 3], max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    assert s.output_token_ids == [1, 42] and s.finish_reason == "stop"


def test_stop_token_wins_over_length_on_the_same_token():
    s = run_one([1, 42], max_tokens=2, stop_token_ids=[42])
    assert s.finish_reason == "stop"


def test_min_tokens_defers_stop_tokens_and_eos():
    s = run_one([EOS, 42, EOS, 42, 5], max_tokens=10, min_tokens=3, stop_token_ids=[42])
    assert s.output_token_ids == [EOS, 42, EOS] and s.finish_reason == "stop"
    s = run_one([EOS, 42, 1, 42], max_tokens=10, min_tokens=3, stop_token_ids=[42])
    assert s.output_token_ids == [EOS, 42, 1, 42] and s.finish_reason == "stop"


def test_max_model_len_is_length():
    s = run_one([1] * 10, prompt_len=10, max_model_len=12, max_tokens=100)
    assert s.num_tokens == 12 and s.output_token_ids == [1, 1] and s.finish_reason == "length"


def test_finish_frees_blocks_wherever_the_sequence_is():
    p = make("mixed", chunk_token_budget=4)
    running, waiting = make_seq("r", 10), make_seq("w", 10, start=100)
    p.add(running)
    step(p)
    p.add(waiting)
    assert p.blocks.has_blocks("r")
    p.finish(running, "abort")
    p.finish(waiting, "abort")
    for s in (running, waiting):
        assert s.is_finished and s.finish_reason == "abort" and not p.blocks.has_blocks(s.seq_id)
    assert not p.running and not p.waiting and not p.has_work()
    assert p.blocks.num_free_blocks == p.blocks.num_blocks
    p.blocks.check_integrity()


def test_sequence_aborted_while_its_step_runs_is_skipped():
    p = make("mixed")
    a, b = make_seq("a", 5), make_seq("b", 5, start=100)
    p.add(a)
    p.add(b)
    plan = p.schedule()
    p.finish(a, "abort")
    updated = complete(p, plan)
    assert updated == [b] and a.num_output_tokens == 0 and a.finish_reason == "abort"


# ---------------------------------------------------------------------------------------------
# KV import (token role)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["token", "mixed"])
def test_reserve_and_complete_import(name):
    p = make(name)
    s = make_seq("s", 9)
    [block_ids] = p.reserve_import(s)
    assert len(block_ids) == 3 and block_ids == p.blocks.block_table("s")
    assert s.status is SequenceStatus.IMPORTING and s.num_computed_tokens == 0 and p.held["s"] is s
    assert not p.schedule() and not p.has_work()  # not schedulable before its KV lands
    out = p.complete_import("s", 77)
    assert out is s and s.status is SequenceStatus.RUNNING and s in p.running and "s" not in p.held
    assert s.num_computed_tokens == 9 and s.output_token_ids == [77] and s.is_decoding
    plan, updated = step(p, token=78)
    assert shape(plan) == [("s", 1)] and plan.scheduled[0].start == 9 and updated == [s]
    assert s.output_token_ids == [77, 78]
    p.blocks.check_integrity()


def test_imported_blocks_are_shared_by_a_later_prefix():
    p = make("token")
    import_seq(p, make_seq("s", 9))
    hits = p.blocks.num_cache_hit_blocks
    t = make_seq("t", 10)  # same first 9 tokens
    p.add(t)
    plan, _ = step(p)
    assert p.blocks.num_cache_hit_blocks == hits + 2 and t.num_cached_tokens == 8
    assert ("t", 2) in shape(plan)


@pytest.mark.parametrize("first,params,reason", [(EOS, {}, "stop"), (5, {"max_tokens": 1}, "length"),
                                                 (42, {"stop_token_ids": [42]}, "stop")])
def test_complete_import_can_finish_at_once(first, params, reason):
    p = make("token")
    s = import_seq(p, make_seq("s", 9, **params), first_token=first)
    assert s.is_finished and s.finish_reason == reason and s not in p.running
    assert p.blocks.num_free_blocks == p.blocks.num_blocks


def test_finish_an_importing_sequence_frees_its_reservation():
    p = make("token")
    s = make_seq("s", 9)
    p.reserve_import(s)
    p.finish(s, "abort")
    assert not p.held and p.blocks.num_free_blocks == p.blocks.num_blocks
    p.blocks.check_integrity()


def test_import_beyond_max_num_seqs_is_refused():
    blocks = BlockManager(64, block_size=4)
    p = TokenPolicy(blocks, SchedulerLimits(max_num_seqs=2, max_model_len=64))
    for i in range(2):
        p.reserve_import(Sequence(str(i), [1, 2, 3], SamplingParams()))
    with pytest.raises(EngineFullError, match="max_num_seqs=2"):
        p.reserve_import(Sequence("2", [1, 2, 3], SamplingParams()))
    p.check_integrity()
