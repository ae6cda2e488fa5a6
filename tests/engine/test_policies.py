"""Per-policy scheduling tests for `splitserve.engine.policies` (pure Python, no model).

A policy is driven the way the engine drives it: `schedule()` -> fake sampled tokens ->
`complete_step()`. Stop conditions, finish and KV import are in test_policy_lifecycle.py, the
randomized simulations in test_policy_simulation.py, windowed models' chunk-by-chunk blocks in
test_policies_windowed.py.
"""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import OutOfBlocksError
from splitserve.engine.policies import POLICY_CLASSES
from splitserve.engine.policies.base import WATERMARK_FRACTION, EngineFullError
from splitserve.engine.policies.orca import MAX_SKIPS
from splitserve.engine.sequence import SequenceStatus
from tests.engine.policy_helpers import complete, import_seq, make, make_seq, shape, step


def test_make_policy_names():
    assert set(POLICY_CLASSES) == {"prompt", "token", "mixed", "prefill_first", "orca", "accelgen",
                                   "accelgen_prompt"}
    for name in POLICY_CLASSES:
        assert make(name).name == name
    with pytest.raises(ValueError, match="policy"):
        make("nope")


# ---------------------------------------------------------------------------------------------
# PromptPolicy
# ---------------------------------------------------------------------------------------------

def test_prompt_batches_whole_prompts_fcfs_up_to_budget():
    p = make("prompt", prompt_token_budget=100)
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 10)]
    seqs = {n: make_seq(n, size, start=1000 * i) for i, (n, size) in enumerate(sizes)}
    for s in seqs.values():
        p.add(s)
    plan = p.schedule()
    # c would make 110 > 100; d would fit, but FCFS stops at c
    assert shape(plan) == [("a", 40), ("b", 40)]
    assert all(item.samples and item.start == 0 for item in plan.scheduled)
    complete(p, plan)
    plan = p.schedule()
    assert shape(plan) == [("c", 30), ("d", 10)]
    complete(p, plan)
    assert not p.has_work() and not p.schedule()


def test_prompt_first_prompt_alone_may_exceed_budget():
    p = make("prompt", prompt_token_budget=100)
    p.add(make_seq("a", 150))
    p.add(make_seq("b", 10, start=500))
    plan, _ = step(p)
    assert shape(plan) == [("a", 150)]
    plan, _ = step(p)
    assert shape(plan) == [("b", 10)]


def test_prompt_holds_sequences_prefilled_with_their_kv():
    p = make("prompt")
    a, b = make_seq("a", 9), make_seq("b", 5, start=100)
    p.add(a)
    p.add(b)
    free_before = p.blocks.num_free_blocks
    _, updated = step(p, tokens={"a": 11, "b": 12})
    assert updated == [a, b]
    for seq, tok in ((a, 11), (b, 12)):
        assert seq.status is SequenceStatus.PREFILLED
        assert seq.output_token_ids == [tok]
        assert seq.num_computed_tokens == seq.num_prompt_tokens
        assert p.held[seq.seq_id] is seq and seq not in p.running and p.find(seq.seq_id) is seq
        assert len(p.blocks.block_table(seq.seq_id)) == p.blocks.blocks_for(seq.num_prompt_tokens)
    assert not p.has_work()
    assert not p.schedule()  # held sequences are never scheduled again
    assert p.blocks.num_free_blocks == free_before - 3 - 2
    p.finish(a, "abort")  # what release_request does after the export
    p.finish(b, "abort")
    assert p.blocks.num_free_blocks == free_before and not p.held
    p.blocks.check_integrity()


def test_prompt_admission_waits_for_kv_blocks():
    p = make("prompt", num_blocks=10)
    a, b, c = make_seq("a", 20), make_seq("b", 20, start=100), make_seq("c", 4, start=200)
    for s in (a, b, c):
        p.add(s)
    plan, _ = step(p)
    assert shape(plan) == [("a", 20), ("b", 20)]
    assert p.blocks.num_free_blocks == 0
    assert not p.schedule() and p.has_work()  # c waits: held prompts occupy the cache
    p.finish(a, "abort")
    plan, _ = step(p)
    assert shape(plan) == [("c", 4)]


def test_prompt_max_tokens_one_finishes_instead_of_holding():
    p = make("prompt")
    a = make_seq("a", 6, max_tokens=1)
    p.add(a)
    step(p)
    assert a.finish_reason == "length" and not p.held
    assert p.blocks.num_free_blocks == p.blocks.num_blocks


# ---------------------------------------------------------------------------------------------
# TokenPolicy
# ---------------------------------------------------------------------------------------------

def test_token_decodes_every_running_sequence_each_step():
    p = make("token")
    sizes = [("a", 5), ("b", 9), ("c", 3)]
    seqs = [import_seq(p, make_seq(n, size, start=100 * i)) for i, (n, size) in enumerate(sizes)]
    for i in range(3):
        plan, updated = step(p)
        assert shape(plan) == [("a", 1), ("b", 1), ("c", 1)]
        assert all(item.samples for item in plan.scheduled)
        assert [item.start for item in plan.scheduled] == [s.num_tokens - 2 for s in seqs]
        assert updated == seqs
    assert [s.num_output_tokens for s in seqs] == [4, 4, 4]


def test_token_admits_whole_prompts_with_decodes():
    p = make("token")
    a = import_seq(p, make_seq("a", 5))
    p.add(make_seq("b", 30, start=100))
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 30)]
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 1)]
    assert a.num_output_tokens == 3


def test_token_preempts_youngest_first_by_recompute_and_reprefills_later():
    p = make("token", num_blocks=7, prefix=False)
    a = import_seq(p, make_seq("a", 7), first_token=1)          # 2 blocks
    import_seq(p, make_seq("b", 7, start=100), first_token=2)  # 2 blocks
    c = import_seq(p, make_seq("c", 9, start=200), first_token=3)  # 3 blocks
    assert p.blocks.num_free_blocks == 0
    plan, _ = step(p, tokens={"a": 11, "b": 12, "c": 13})  # every next slot is inside a held block
    assert shape(plan) == [("a", 1), ("b", 1), ("c", 1)] and not plan.preempted
    d = make_seq("d", 1, start=300)
    p.add(d)
    # a and b now need a third block each, none is free: c, the youngest, goes
    plan, _ = step(p, tokens={"a": 21, "b": 22})
    assert shape(plan) == [("a", 1), ("b", 1)]
    assert plan.preempted == (c,)
    assert c.status is SequenceStatus.WAITING and list(p.waiting) == [c, d]
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and p.num_preemptions == 1
    assert not p.blocks.has_blocks("c") and c.output_token_ids == [3, 13]
    assert d.status is SequenceStatus.WAITING
    with pytest.raises(EngineFullError, match="preempted sequence waits"):  # c goes first: no import takes its blocks
        p.reserve_import(make_seq("e", 2, start=400))
    assert not p.blocks.has_blocks("e") and "e" not in p.held
    # c cannot come back while a and b hold the cache; they decode on
    plan, _ = step(p, tokens={"a": 31, "b": 32})
    assert shape(plan) == [("a", 1), ("b", 1)]
    p.finish(a, "stop")
    # now c is prefilled again, prompt and outputs whole, and samples its next token
    plan, _ = step(p, tokens={"b": 42, "c": 43, "d": 44})
    assert shape(plan) == [("b", 1), ("c", 11), ("d", 1)]
    assert c.output_token_ids == [3, 13, 43] and c.status is SequenceStatus.RUNNING
    assert c.is_decoding and d.is_decoding
    with pytest.raises(OutOfBlocksError):  # c runs again: only the free blocks limit imports now
        p.reserve_import(make_seq("e", 2, start=400))


def test_token_preempts_the_asking_sequence_when_it_is_the_youngest():
    p = make("token", num_blocks=4, prefix=False)
    a = import_seq(p, make_seq("a", 6))           # 7 tokens: its next slots stay in block 2
    b = import_seq(p, make_seq("b", 7, start=100))  # 8 tokens: needs a third block after one step
    step(p)
    plan, _ = step(p)
    assert shape(plan) == [("a", 1)] and plan.preempted == (b,)
    assert a.status is SequenceStatus.RUNNING and list(p.waiting) == [b]


# ---------------------------------------------------------------------------------------------
# MixedPolicy
# ---------------------------------------------------------------------------------------------

def test_mixed_decodes_then_partial_prefills_then_new_prompts():
    p = make("mixed", chunk_token_budget=10)
    a, b, c = make_seq("a", 3), make_seq("b", 15, start=100), make_seq("c", 6, start=200)
    p.add(a)
    plan, _ = step(p)
    assert shape(plan) == [("a", 3)]
    p.add(b)
    plan, updated = step(p)
    assert shape(plan) == [("a", 1), ("b", 9)]
    assert [item.samples for item in plan.scheduled] == [True, False] and updated == [a]
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0
    p.add(c)
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 6), ("c", 3)]  # chunk = min(remaining, budget left)
    assert [item.samples for item in plan.scheduled] == [True, True, False]
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 1), ("c", 3)]
    assert plan.num_tokens <= 10
    assert c.is_decoding


def test_mixed_chunks_a_long_prompt_under_the_budget():
    p = make("mixed", chunk_token_budget=8)
    a = make_seq("a", 30)
    p.add(a)
    sizes = []
    while not a.num_output_tokens:
        plan, _ = step(p)
        sizes.append(shape(plan)[0][1])
        assert a.num_computed_tokens == sum(sizes)
    assert sizes == [8, 8, 8, 6]


def test_a_plans_work_counts_each_chunks_context():
    p = make("mixed", chunk_token_budget=8)
    p.add(make_seq("a", 3))
    step(p)  # a prefilled: it decodes from now on
    p.add(make_seq("b", 20, start=100))
    works = []
    while p.has_work():
        plan = p.schedule()
        works.append(plan.work())
        complete(p, plan)
    # a's decode at context 4 beside b's first chunk of 7, then a's decode at 5 beside b's next 7 after 7 computed
    assert [(w.prefill_tokens, w.decode_tokens, w.decode_context_tokens) for w in works[:2]] == [(7, 1, 4), (7, 1, 5)]
    assert [w.chunk_context_tokens for w in works[:3]] == [0, 7 * 7, 6 * 14]
    assert [w.prefill_attention_pairs for w in works[:3]] == [7 * 7, 7 * (14 + 7), 6 * (28 + 6)]


def test_mixed_runs_all_decodes_even_over_the_budget_and_admits_nothing():
    p = make("mixed", chunk_token_budget=2)
    for i in range(3):
        import_seq(p, make_seq(str(i), 5, start=100 * i))
    p.add(make_seq("w", 4, start=900))
    plan, _ = step(p)
    assert shape(plan) == [("0", 1), ("1", 1), ("2", 1)]
    assert p.waiting[0].seq_id == "w"


def test_mixed_admission_keeps_a_watermark_of_free_blocks():
    p = make("mixed", num_blocks=200, chunk_token_budget=4096)
    watermark = int(WATERMARK_FRACTION * 200)
    assert watermark == 2
    a = make_seq("a", 779)  # 195 blocks; 195 + 2 <= 200
    p.add(a)
    step(p)
    assert p.blocks.num_free_blocks == 5
    b = make_seq("b", 16, start=1000)  # 4 blocks: fits, but not above the watermark
    p.add(b)
    assert p.blocks.can_allocate(b)
    plan, _ = step(p)
    assert shape(plan) == [("a", 1)] and b.status is SequenceStatus.WAITING
    p.finish(b, "abort")
    c = make_seq("c", 8, start=2000)  # a grows to 196 blocks this step: 4 free = 2 blocks + 2
    p.add(c)
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("c", 8)]


def test_mixed_respects_max_num_seqs():
    p = make("mixed", max_num_seqs=2)
    for i in range(3):
        p.add(make_seq(str(i), 4, start=100 * i))
    plan, _ = step(p)
    assert shape(plan) == [("0", 4), ("1", 4)]


def test_mixed_preempts_a_younger_partial_prefill_and_admits_nothing_that_step():
    p = make("mixed", num_blocks=6, chunk_token_budget=8, prefix=False)
    a = make_seq("a", 3)
    p.add(a)
    step(p)                                 # a: 4 tokens, 1 block
    b = make_seq("b", 20, start=100)        # 5 blocks
    p.add(b)
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 7)] and p.blocks.num_free_blocks == 0
    w = make_seq("w", 2, start=500)
    p.add(w)
    plan, _ = step(p)                       # a needs its 2nd block: b goes
    assert shape(plan) == [("a", 1)] and plan.preempted == (b,)
    assert list(p.waiting) == [b, w] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    plan, _ = step(p)                       # b needs 5 blocks, 4 are free: it waits
    assert shape(plan) == [("a", 1)]
    p.finish(a, "stop")
    plan, _ = step(p)
    assert shape(plan) == [("b", 8)]


# ---------------------------------------------------------------------------------------------
# PrefillFirstPolicy
# ---------------------------------------------------------------------------------------------

def test_prefill_first_waiting_prompts_go_first_and_plans_are_pure():
    p = make("prefill_first", prompt_token_budget=100)
    a = make_seq("a", 5)
    p.add(a)
    plan, _ = step(p)
    assert shape(plan) == [("a", 5)]
    plan, _ = step(p)
    assert shape(plan) == [("a", 1)]
    p.add(make_seq("b", 60, start=100))
    p.add(make_seq("c", 30, start=200))
    p.add(make_seq("d", 30, start=300))
    plan, _ = step(p)
    assert shape(plan) == [("b", 60), ("c", 30)]  # a stalls: no decode in a prefill step
    plan, _ = step(p)
    assert shape(plan) == [("d", 30)]
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_prefill_first_decodes_when_the_waiting_prompt_does_not_fit():
    p = make("prefill_first", num_blocks=4)
    a = make_seq("a", 5)
    p.add(a)
    step(p)
    p.add(make_seq("b", 12, start=100))  # 3 blocks; 2 free
    plan, _ = step(p)
    assert shape(plan) == [("a", 1)]
    p.finish(a, "stop")
    plan, _ = step(p)
    assert shape(plan) == [("b", 12)]


# ---------------------------------------------------------------------------------------------
# OrcaPolicy (Splitwise's mixed continuous batching)
# ---------------------------------------------------------------------------------------------

def decoding(p, names, size=5):
    """Admit `names` one by one and prefill each: they end up decoding, oldest first."""
    for i, name in enumerate(names):
        p.add(make_seq(name, size, start=100 * (i + 1)))
        step(p)


def test_orca_batches_whole_prompts_with_the_decodes_that_fit():
    p = make("orca", num_blocks=256, prompt_token_budget=40)
    decoding(p, ["a", "b", "c"])
    p.add(make_seq("x", 20, start=1000))
    p.add(make_seq("y", 18, start=2000))
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 1), ("x", 20), ("y", 18)]  # 40 tokens: c is left out
    assert [s.num_skips for s in p.running] == [0, 0, 1, 0, 0]
    plan, _ = step(p)
    assert shape(plan) == [("a", 1), ("b", 1), ("c", 1), ("x", 1), ("y", 1)]  # no prompt: every decode


def test_orca_stops_prompts_fcfs_at_the_budget_and_lets_a_lone_prompt_exceed_it():
    p = make("orca", num_blocks=256, prompt_token_budget=40)
    p.add(make_seq("big", 50))
    p.add(make_seq("small", 3, start=1000))
    plan, _ = step(p)
    assert shape(plan) == [("big", 50)]  # alone in the batch it may exceed the budget; small waits
    plan, _ = step(p)
    assert shape(plan) == [("big", 1), ("small", 3)]


def test_orca_decode_left_out_max_skips_times_in_a_row_goes_before_prompts():
    p = make("orca", num_blocks=256, prompt_token_budget=16)
    decoding(p, ["a"])
    for i in range(MAX_SKIPS):
        p.add(make_seq(f"p{i}", 16, start=1000 * (i + 1)))
        plan, _ = step(p)
        assert (f"p{i}", 16) in shape(plan) and ("a", 1) not in shape(plan)  # the prompt fills the budget
    a = p.find("a")
    assert a.num_skips == MAX_SKIPS
    p.add(make_seq("late", 16, start=9000))
    plan, _ = step(p)
    # a goes first; the prompt no longer fits beside it, and the budget's rest goes to the other decodes
    assert shape(plan)[0] == ("a", 1) and ("late", 16) not in shape(plan)
    assert plan.num_tokens == 1 + MAX_SKIPS and a.num_skips == 0
    plan, _ = step(p)  # served, a waits its turn again: the prompt fills the budget
    assert shape(plan) == [("late", 16)] and a.num_skips == 1


def test_orca_admits_no_prompt_in_a_step_that_preempts():
    p = make("orca", num_blocks=4, prefix=False, prompt_token_budget=64)
    import_seq(p, make_seq("a", 6))           # 7 tokens: its next slots stay in block 2
    import_seq(p, make_seq("b", 7, start=100))  # 8 tokens: needs a third block after one step
    step(p)
    p.add(make_seq("x", 2, start=1000))
    plan, _ = step(p)
    assert [s.seq_id for s in plan.preempted] == ["b"] and shape(plan) == [("a", 1)]
