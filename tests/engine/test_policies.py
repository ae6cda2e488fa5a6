"""Tests for the scheduling policies (`splitserve.engine.policies`), pure Python, no model.

A policy is driven the way the engine drives it: `schedule()` -> fake sampled tokens ->
`complete_step()`. The randomized simulations also simulate the KV cache itself: every slot a
step (or a KV import) writes records an id of the whole token prefix up to that position, and
before a step computes `token_ids[start:start + n]` every position < start must read back its
own prefix id through the block table. That checks that policies only ever schedule work whose
context KV is really there (chunking, preemption by recompute, prefix sharing, imports).
"""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import POLICY_CLASSES, SchedulerLimits, make_policy
from splitserve.engine.policies.base import WATERMARK_FRACTION, EngineFullError
from splitserve.engine.policies.token import TokenPolicy
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence, SequenceStatus

EOS = 999
BS = 4


def make_seq(seq_id: str, n: int, start: int = 0, **params) -> Sequence:
    """A sequence with prompt `start .. start + n - 1` (distinct starts: no accidental prefix hits)."""
    params.setdefault("max_tokens", 16)
    return Sequence(seq_id, list(range(start, start + n)), SamplingParams(**params),
                    eos_token_ids=frozenset({EOS}))


def make(name: str, num_blocks: int = 64, block_size: int = BS, prefix: bool = True, **limits):
    return make_policy(name, BlockManager(num_blocks, block_size, prefix), SchedulerLimits(**limits))


def shape(plan) -> list[tuple[str, int]]:
    return [(item.seq.seq_id, item.num_new_tokens) for item in plan.scheduled]


def complete(policy, plan, token: int = 7, tokens: dict[str, int] | None = None):
    sampled = {item.seq.seq_id: (tokens or {}).get(item.seq.seq_id, token)
               for item in plan.scheduled if item.samples}
    updated = policy.complete_step(plan, sampled)
    policy.blocks.check_integrity()
    return updated


def step(policy, token: int = 7, tokens: dict[str, int] | None = None):
    plan = policy.schedule()
    policy.blocks.check_integrity()
    return plan, complete(policy, plan, token, tokens)


def import_seq(policy, seq: Sequence, first_token: int = 7) -> Sequence:
    policy.reserve_import(seq)
    return policy.complete_import(seq.seq_id, first_token)


def test_make_policy_names():
    assert set(POLICY_CLASSES) == {"prompt", "token", "mixed", "prefill_first"}
    for name in POLICY_CLASSES:
        assert make(name).name == name
    with pytest.raises(ValueError, match="policy"):
        make("nope")


# ---------------------------------------------------------------------------------------------
# PromptPolicy
# ---------------------------------------------------------------------------------------------

def test_prompt_batches_whole_prompts_fcfs_up_to_budget():
    p = make("prompt", prompt_token_budget=100)
    seqs = {n: make_seq(n, size, start=1000 * i) for i, (n, size) in enumerate([("a", 40), ("b", 40), ("c", 30), ("d", 10)])}
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
    seqs = [import_seq(p, make_seq(n, size, start=100 * i)) for i, (n, size) in enumerate([("a", 5), ("b", 9), ("c", 3)])]
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
    b = import_seq(p, make_seq("b", 7, start=100), first_token=2)  # 2 blocks
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
    # c cannot come back while a and b hold the cache; they decode on
    plan, _ = step(p, tokens={"a": 31, "b": 32})
    assert shape(plan) == [("a", 1), ("b", 1)]
    p.finish(a, "stop")
    # now c is prefilled again, prompt and outputs whole, and samples its next token
    plan, _ = step(p, tokens={"b": 42, "c": 43, "d": 44})
    assert shape(plan) == [("b", 1), ("c", 11), ("d", 1)]
    assert c.output_token_ids == [3, 13, 43] and c.status is SequenceStatus.RUNNING
    assert c.is_decoding and d.is_decoding


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
    block_ids = p.reserve_import(s)
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


# ---------------------------------------------------------------------------------------------
# randomized simulations
# ---------------------------------------------------------------------------------------------

class FakeKV:
    """Slot -> id of the token prefix whose last token's KV sits there."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.slots: dict[int, int] = {}
        self._prefix_ids: dict[int, list[int]] = {}

    def prefix_id(self, seq: Sequence, pos: int) -> int:
        ids = self._prefix_ids.setdefault(id(seq), [])
        while len(ids) <= pos:
            ids.append(hash((ids[-1] if ids else None, seq.token_ids[len(ids)])))
        return ids[pos]

    def slot(self, seq: Sequence, pos: int) -> int:
        table = self.blocks.block_table(seq.seq_id)
        assert pos // self.blocks.block_size < len(table), f"{seq.seq_id}: no block for position {pos}"
        return table[pos // self.blocks.block_size] * self.blocks.block_size + pos % self.blocks.block_size

    def check(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            assert self.slots.get(self.slot(seq, pos)) == self.prefix_id(seq, pos), \
                f"{seq.seq_id}: stale KV at position {pos}"

    def write(self, seq: Sequence, start: int, n: int) -> None:
        for pos in range(start, start + n):
            self.slots[self.slot(seq, pos)] = self.prefix_id(seq, pos)


def expected_outputs(tokens: list[int], params: SamplingParams, prompt_len: int, max_model_len: int):
    """The stop rules, written out independently."""
    out = []
    for tok in tokens:
        out.append(tok)
        if len(out) >= params.min_tokens and (tok in params.stop_token_ids or (not params.ignore_eos and tok == EOS)):
            return out, "stop"
        if len(out) >= params.max_tokens or prompt_len + len(out) >= max_model_len:
            return out, "length"
    raise AssertionError("token stream too short")


class Sim:
    """Requests with shared prefixes arrive at random steps; a few are aborted; sampled tokens are a
    fixed function of (request, output index), so preemption must not change any output."""

    MAX_MODEL_LEN = 64

    def __init__(self, seed: int, name: str):
        rng = self.rng = random.Random(seed)
        self.name = name
        self.num_requests = 40
        bases = [[rng.randrange(6) for _ in range(rng.randint(4, 30))] for _ in range(4)]
        self.requests = []
        for i in range(self.num_requests):
            base = rng.choice(bases)
            prompt = base[:rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 30)
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                                    ignore_eos=rng.random() < 0.3,
                                    stop_token_ids=[5] if rng.random() < 0.3 else [])
            tokens = [EOS if rng.random() < 0.05 else rng.randrange(6) for _ in range(self.MAX_MODEL_LEN)]
            self.requests.append((str(i), prompt, params, tokens))
        self.arrivals = sorted(rng.randrange(60) for _ in range(self.num_requests))

    def limits(self) -> SchedulerLimits:
        rng = self.rng
        return SchedulerLimits(max_num_seqs=rng.choice([2, 6, 64]), max_model_len=self.MAX_MODEL_LEN,
                               prompt_token_budget=rng.choice([8, 32, 128]),
                               chunk_token_budget=rng.choice([3, 16, 64]))

    def blocks(self, block_size: int | None = None) -> BlockManager:
        rng = self.rng
        block_size = block_size or rng.choice([1, 4, 8])
        # at least max_model_len tokens, plus the admission watermark (>= 100 blocks keep one)
        min_blocks = -(-self.MAX_MODEL_LEN // block_size)
        num_blocks = rng.choice([min_blocks, min_blocks + 3, 2 * min_blocks, 120])
        num_blocks = max(num_blocks, min_blocks + int(WATERMARK_FRACTION * num_blocks))
        return BlockManager(num_blocks, block_size, enable_prefix_caching=rng.random() < 0.8)

    def new_seq(self, index: int) -> Sequence:
        seq_id, prompt, params, _ = self.requests[index]
        return Sequence(seq_id, list(prompt), params, eos_token_ids=frozenset({EOS}))

    def token_for(self, seq: Sequence) -> int:
        return self.requests[int(seq.seq_id)][3][seq.num_output_tokens]

    def run_policy_step(self, policy, kv: FakeKV) -> None:
        """schedule, check the plan, simulate the model (KV reads and writes), complete."""
        running_before = {s.seq_id: s.is_decoding for s in policy.running}
        waiting_before = {s.seq_id for s in policy.waiting}
        plan = policy.schedule()
        policy.blocks.check_integrity()
        self.check_plan(policy, plan, running_before, waiting_before)
        for item in plan.scheduled:
            kv.check(item.seq, item.start)
            kv.write(item.seq, item.start, item.num_new_tokens)
        sampled = {item.seq.seq_id: self.token_for(item.seq) for item in plan.scheduled if item.samples}
        policy.complete_step(plan, sampled)
        policy.blocks.check_integrity()
        self.check_state(policy)

    def check_plan(self, policy, plan, running_before, waiting_before) -> None:
        items = plan.scheduled
        ids = [item.seq.seq_id for item in items]
        assert len(set(ids)) == len(ids)
        limits = policy.limits
        for item in items:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq in policy.running
            assert item.start == seq.num_computed_tokens and item.num_new_tokens >= 1
            assert item.start + item.num_new_tokens <= seq.num_tokens
            assert item.samples == (item.start + item.num_new_tokens == seq.num_tokens)
            assert seq.seq_id in running_before or seq.seq_id in waiting_before
        new = [item for item in items if item.seq.seq_id in waiting_before]
        if new:  # admission from the queue respects max_num_seqs (imports are not counted against it)
            assert len(policy.running) <= limits.max_num_seqs
        for seq in plan.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert seq.seq_id in running_before and not policy.blocks.has_blocks(seq.seq_id)
            assert seq.seq_id not in ids
        if plan.preempted:
            assert not new, "a prompt was admitted in a step that preempted"
        kinds = ["new" if i.seq.seq_id in waiting_before else
                 "decode" if running_before[i.seq.seq_id] else "partial" for i in items]
        served = set(ids) | {s.seq_id for s in plan.preempted}
        if self.name in ("token", "mixed"):
            # every sequence that was decoding is decoded (or preempted)
            assert all(sid in served for sid, dec in running_before.items() if dec)
            assert all(i.num_new_tokens == 1 for i, k in zip(items, kinds) if k == "decode")
        if self.name == "mixed":
            order = {"decode": 0, "partial": 1, "new": 2}
            assert [order[k] for k in kinds] == sorted(order[k] for k in kinds)
            budget = limits.chunk_token_budget
            num_decodes = kinds.count("decode")
            if num_decodes <= budget:
                assert plan.num_tokens <= budget
            used = num_decodes
            for item, kind in zip(items, kinds):
                if kind != "decode":
                    assert item.num_new_tokens == min(item.seq.num_tokens - item.start, budget - used)
                    used += item.num_new_tokens
        else:
            # whole prompts only: every non-decode item runs to the end and samples
            assert all(i.samples for i in items)
            assert "partial" not in kinds
            if len(new) > 1:
                assert sum(i.num_new_tokens for i in new) <= limits.prompt_token_budget
        if self.name == "prefill_first":
            assert set(kinds) <= {"new"} or set(kinds) <= {"decode"}
            if not new:  # a step without prefills decodes every decoding sequence
                assert all(sid in served for sid, dec in running_before.items() if dec)
        if self.name == "prompt":
            assert kinds == ["new"] * len(kinds)

    def check_state(self, policy) -> None:
        for seq in policy.running:
            assert seq.status is SequenceStatus.RUNNING and policy.blocks.has_blocks(seq.seq_id)
            assert seq.num_computed_tokens < seq.num_tokens
        for seq in policy.waiting:
            assert seq.status is SequenceStatus.WAITING and not policy.blocks.has_blocks(seq.seq_id)
            assert seq.num_computed_tokens == 0
        for seq in policy.held.values():
            assert seq.status in (SequenceStatus.PREFILLED, SequenceStatus.IMPORTING)
            assert policy.blocks.has_blocks(seq.seq_id)

    def check_finished(self, seqs: dict[str, Sequence], aborted: set[str]) -> None:
        assert len(seqs) == self.num_requests
        for seq_id, prompt, params, tokens in self.requests:
            seq = seqs[seq_id]
            assert seq.is_finished, seq_id
            assert seq.prompt_token_ids == prompt
            if seq_id in aborted:
                assert seq.finish_reason == "abort"
                continue
            out, reason = expected_outputs(tokens, params, len(prompt), self.MAX_MODEL_LEN)
            assert (seq.output_token_ids, seq.finish_reason) == (out, reason), seq_id


def maybe_abort(sim: Sim, policy, seqs, aborted) -> None:
    if sim.rng.random() < 0.03:
        live = [s for s in seqs.values() if not s.is_finished]
        if live:
            victim = sim.rng.choice(live)
            policy.finish(victim, "abort")
            aborted.add(victim.seq_id)
            policy.blocks.check_integrity()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["mixed", "prefill_first", "token"])
def test_random_simulation_runs_to_completion(name, seed):
    sim = Sim(seed, name)
    blocks = sim.blocks()
    policy = make_policy(name, blocks, sim.limits())
    kv = FakeKV(blocks)
    seqs: dict[str, Sequence] = {}
    aborted: set[str] = set()
    importing: list[Sequence] = []
    arrived, steps = 0, 0
    while arrived < sim.num_requests or policy.has_work() or importing or policy.held:
        while arrived < sim.num_requests and sim.arrivals[arrived] <= steps:
            seq = seqs.setdefault(str(arrived), sim.new_seq(arrived))
            arrived += 1
            has_room = len(policy.running) + len(policy.held) < policy.limits.max_num_seqs
            if (name == "token" and has_room and sim.rng.random() < 0.7
                    and blocks.num_free_blocks >= blocks.blocks_for(seq.num_tokens)):
                # the KV arrives from a prompt machine: reserve, "transfer", complete next step
                policy.reserve_import(seq)
                kv.write(seq, 0, seq.num_prompt_tokens)
                importing.append(seq)
            else:
                policy.add(seq)
        if importing and sim.rng.random() < 0.7:
            seq = importing.pop(0)
            if not seq.is_finished:
                policy.complete_import(seq.seq_id, sim.token_for(seq))
                blocks.check_integrity()
        maybe_abort(sim, policy, seqs, aborted)
        sim.run_policy_step(policy, kv)
        steps += 1
        assert steps < 3000, "simulation does not make progress"
    sim.check_finished(seqs, aborted)
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()
    assert not policy.running and not policy.waiting and not policy.held


@pytest.mark.parametrize("seed", range(6))
def test_random_simulation_prompt_to_token_handoff(seed):
    """A prompt policy prefills and holds; its KV moves to a token policy's own blocks."""
    sim = Sim(seed, "prompt")
    prompt_blocks = sim.blocks()
    token_blocks = sim.blocks(prompt_blocks.block_size)  # a block copy needs the same block size
    prompt = make_policy("prompt", prompt_blocks, sim.limits())
    token = make_policy("token", token_blocks, sim.limits())
    prompt_kv, token_kv = FakeKV(prompt_blocks), FakeKV(token_blocks)
    prompt_seqs: dict[str, Sequence] = {}
    token_seqs: dict[str, Sequence] = {}
    aborted: set[str] = set()
    arrived, steps = 0, 0
    token_sim = Sim(seed, "token")
    while arrived < sim.num_requests or prompt.has_work() or prompt.held or token.has_work():
        while arrived < sim.num_requests and sim.arrivals[arrived] <= steps:
            prompt.add(prompt_seqs.setdefault(str(arrived), sim.new_seq(arrived)))
            arrived += 1
        maybe_abort(sim, prompt, prompt_seqs, aborted)
        # export the held (prefilled) sequences whose KV fits on the token side
        for seq in list(prompt.held.values()):
            assert seq.status is SequenceStatus.PREFILLED and seq.num_output_tokens == 1
            if sim.rng.random() < 0.3:
                continue
            dst = Sequence(seq.seq_id, list(seq.prompt_token_ids), seq.params, seq.arrival_time, seq.eos_token_ids)
            if token_blocks.num_free_blocks < token_blocks.blocks_for(dst.num_tokens):  # imports take fresh blocks
                continue
            if len(token.running) + len(token.held) >= token.limits.max_num_seqs:
                continue
            src_ids = prompt_blocks.export_blocks(seq.seq_id)
            dst_ids = token.reserve_import(dst)
            assert len(src_ids) == len(dst_ids) == token_blocks.blocks_for(seq.num_prompt_tokens)
            prompt_kv.check(seq, seq.num_prompt_tokens)
            for pos in range(seq.num_prompt_tokens):  # the block copy
                token_kv.slots[token_kv.slot(dst, pos)] = prompt_kv.slots[prompt_kv.slot(seq, pos)]
            token.complete_import(seq.seq_id, seq.output_token_ids[0])
            prompt.finish(seq, "abort")  # release_request
            token_seqs[seq.seq_id] = dst
            prompt_blocks.check_integrity()
            token_blocks.check_integrity()
        sim.run_policy_step(prompt, prompt_kv)
        token_sim.run_policy_step(token, token_kv)
        steps += 1
        assert steps < 3000, "simulation does not make progress"
    # a request ends on the prompt side (aborted, or stopped by its first token) or on the token side
    final = {sid: token_seqs.get(sid, seq) for sid, seq in prompt_seqs.items()}
    sim.check_finished(final, aborted)
    for blocks in (prompt_blocks, token_blocks):
        blocks.check_integrity()
        assert blocks.num_free_blocks == blocks.num_blocks


def test_import_beyond_max_num_seqs_is_refused():
    blocks = BlockManager(64, block_size=4)
    p = TokenPolicy(blocks, SchedulerLimits(max_num_seqs=2, max_model_len=64))
    for i in range(2):
        p.reserve_import(Sequence(str(i), [1, 2, 3], SamplingParams()))
    with pytest.raises(EngineFullError, match="max_num_seqs=2"):
        p.reserve_import(Sequence("2", [1, 2, 3], SamplingParams()))
    p.check_integrity()
