"""End to end on the built-in demo model (4 layers, byte tokenizer, seeded dummy weights).

Greedy with ignore_eos=True, so every run of a prompt has a fixed length and the token ids must
agree exactly across policies, chunk budgets, KV handoff, preemption and prefix caching. Prompt
formats, sampling options and bad input are in test_llm_requests.py.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import SequenceStatus
from tests.engine.engine_helpers import (
    ENGINE,
    GREEDY,
    PROMPTS,
    assert_all_free,
    assert_same,
    handed_off,
    run_engine,
    token_ids,
)
from tests.engine.engine_helpers import one_thread, reference  # noqa: F401  (pytest fixtures)


# ---------------------------------------------------------------------------------------------
# the same greedy tokens every way
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [8, 17, 64, 512])
def test_chunked_prefill_equals_full_prefill(reference, budget):
    llm = LLM(policy="mixed", chunk_token_budget=budget, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert_same(outputs, reference)
    assert [out.prompt_token_ids for out in outputs] == PROMPTS
    assert llm.engine.block_manager.num_cache_hit_blocks > 0  # the shared prefix was reused
    assert_all_free(llm.engine)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "orca", "token"])
def test_policies_agree(reference, policy):
    llm = LLM(policy=policy, **ENGINE)
    assert_same(llm.generate(PROMPTS, GREEDY), reference)
    assert_all_free(llm.engine)


def test_prompt_to_token_handoff_in_process(reference):
    assert_same(handed_off(GREEDY), reference, skip_first_logprob=True)  # the token engine learns the first id only


def test_a_seeded_request_handed_off_or_resumed_samples_as_one_run():
    """Its draws follow its output positions, wherever each token is sampled; a resumed request
    (its earlier output at the end of its prompt) also keeps its penalties over that output."""
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=21, ignore_eos=True,
                            frequency_penalty=1.5, presence_penalty=0.5)
    whole = LLM(**ENGINE).generate(PROMPTS, seeded)
    assert token_ids(handed_off(seeded)) == token_ids(whole)
    resumed = LLM(**ENGINE).generate([p + w.token_ids[:5] for p, w in zip(PROMPTS, whole)],
                                     replace(seeded, max_tokens=7, resumed_tokens=5))
    assert [out.token_ids for out in resumed] == [w.token_ids[5:] for w in whole]


def test_preemption_keeps_outputs():
    prompts = [[(7 * i + j) % 256 for j in range(10 + 9 * i)] for i in range(5)]  # 10..46 tokens
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    free = LLM(max_model_len=80, num_kv_blocks=64)
    want = free.generate(prompts, params)
    assert free.engine.policy.num_preemptions == 0
    for policy in ("mixed", "prefill_first", "token"):
        # 6 blocks of 16 = 96 slots >= max_model_len: one request always fits, five do not
        llm = LLM(policy=policy, max_model_len=80, num_kv_blocks=6, chunk_token_budget=32)
        got = llm.generate(prompts, params)
        assert_same(got, want)
        assert llm.engine.policy.num_preemptions > 0, policy
        # a recompute's hits on the blocks it wrote itself are not the prompt's cache hit
        assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want] == [0] * 5, policy
        assert_all_free(llm.engine)


def test_each_steps_output_shares_the_requests_growing_lists():
    """Cumulative outputs cost the same per step however long the output: a later step extends
    the lists an earlier one returned (the text, a string, is each step's own)."""
    engine = LLMEngine(**ENGINE)
    engine.add_request("a", PROMPTS[0], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    first, last = outputs[0], outputs[-1]
    assert len(outputs) == GREEDY.max_tokens and last.finished
    assert first.token_ids is last.token_ids and len(first.token_ids) == GREEDY.max_tokens
    assert first.outputs[0].logprobs is last.outputs[0].logprobs
    assert [len(o.text) for o in outputs] == sorted(len(o.text) for o in outputs) and first.text != last.text


def test_prefix_caching_reuses_blocks_and_keeps_outputs():
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(100)]
    first = shared + [1, 2, 3]
    second = shared + [rng.randrange(256) for _ in range(10)]
    engine = LLMEngine(**ENGINE)
    out1 = run_engine(engine, {"a": (first, GREEDY)})["a"]
    assert (out1.num_cached_tokens, out1.num_cache_write_tokens) == (0, 96)  # its 103 tokens fill 6 blocks
    hits = engine.block_manager.num_cache_hit_blocks
    out2 = run_engine(engine, {"b": (second, GREEDY)})["b"]
    assert out2.num_cached_tokens == 96  # six full blocks of 16 of the shared 100 tokens
    assert out2.num_cache_write_tokens == 0  # its 110 tokens: the same 6 full blocks, a 7th partial one
    assert engine.block_manager.num_cache_hit_blocks == hits + 6
    assert_all_free(engine)
    fresh = LLMEngine(enable_prefix_caching=False, **ENGINE)
    want = run_engine(fresh, {"b": (second, GREEDY)})["b"]
    assert want.num_cached_tokens == want.num_cache_write_tokens == 0 and fresh.block_manager.num_cache_hit_blocks == 0
    assert out2.token_ids == want.token_ids
    # the very same prompt again: all but its last block come from the cache
    out3 = run_engine(engine, {"c": (second, GREEDY)})["c"]
    assert out3.num_cached_tokens == 96 and out3.token_ids == want.token_ids


def test_one_prompt_prefilled_twice_at_once_writes_its_blocks_to_the_cache_once():
    """Usage's cache_write_tokens: neither finds the other's blocks cached (they are computed in
    the same step), and only the first to finish its blocks adds them."""
    prompt = [(3 * i + 1) % 256 for i in range(40)]  # 2 full blocks of 16
    outs = run_engine(LLMEngine(**ENGINE), {"a": (prompt, GREEDY), "b": (prompt, GREEDY)})
    assert [outs[r].num_cached_tokens for r in "ab"] == [0, 0]
    assert sorted(outs[r].num_cache_write_tokens for r in "ab") == [0, 32]


# ---------------------------------------------------------------------------------------------
# abort and capacity
# ---------------------------------------------------------------------------------------------

def test_abort_mid_generation_frees_blocks():
    engine = LLMEngine(policy="mixed", chunk_token_budget=32, **ENGINE)
    total = engine.block_manager.num_blocks
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(str(i), prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < total
    statuses = {engine.policy.find(str(i)).status for i in range(6)}
    assert SequenceStatus.RUNNING in statuses and SequenceStatus.WAITING in statuses
    engine.abort("0")        # decoding
    engine.abort("5")        # waiting or mid-prefill
    engine.abort("unknown")  # no-op
    engine.block_manager.check_integrity()
    assert engine.num_requests == 4
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("0", "5")
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"1", "2", "3", "4"}
    assert_all_free(engine)
    # abort everything mid-flight
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"x{i}", prompt, params)
    engine.step()
    engine.step()
    for i in range(6):
        engine.abort(f"x{i}")
    assert_all_free(engine)


def test_abort_a_prefilled_and_an_importing_request():
    prompt_engine = LLMEngine(policy="prompt", **ENGINE)
    prompt_engine.add_request("p", PROMPTS[3], GREEDY)
    prompt_engine.step()
    assert prompt_engine.block_manager.num_free_blocks < prompt_engine.block_manager.num_blocks
    prompt_engine.abort("p")
    assert_all_free(prompt_engine)
    token_engine = LLMEngine(policy="token", **ENGINE)
    token_engine.reserve_import("t", PROMPTS[3], GREEDY)
    token_engine.abort("t")
    assert_all_free(token_engine)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "orca", "token"])
def test_prompt_that_needs_the_whole_cache_is_scheduled(policy):
    engine = LLMEngine(policy=policy, num_kv_blocks=100, max_model_len=1600)  # 100 * 16 = 1600 slots
    engine.add_request("long", [7] * 1599, SamplingParams(max_tokens=1, temperature=0.0))
    outputs = []
    for _ in range(5):
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert outputs and outputs[-1].finished
