"""Shared constants, helpers and fixtures for the end-to-end tests on the built-in demo model
(test_llm_engine, test_llm_requests).

The fixtures are imported by name into each test module, so `one_thread` (autouse) and
`reference` keep their module scope there: one thread while a module runs, one reference per
module.
"""
from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import SequenceStatus
from splitserve.transfer.codec import pack_all, slot_index, unpack_all

ENGINE = dict(num_kv_blocks=192)  # 3072 token slots: plenty, and a small tensor
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 1e-4


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 64, 150, 300, 33)]
    prompts.append(prompts[4][:100] + [rng.randrange(256) for _ in range(20)])  # shares 100 tokens
    return prompts


PROMPTS = _prompts()


def token_ids(outputs) -> list[list[int]]:
    return [out.token_ids for out in outputs]


def assert_same(outputs, reference, skip_first_logprob: bool = False) -> None:
    """Identical greedy tokens, and the same top logprobs (so the KV read was the same, not just
    close enough to keep the argmax)."""
    assert token_ids(outputs) == token_ids(reference)
    for out, ref in zip(outputs, reference):
        got, want = out.outputs[0].logprobs, ref.outputs[0].logprobs
        assert len(got) == len(want) == len(out.token_ids)
        for i, (a, b) in enumerate(zip(got, want)):
            if i == 0 and skip_first_logprob:
                continue
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) <= LOGPROB_TOL for t in a), (out.request_id, i, a, b)


def assert_all_free(engine: LLMEngine) -> None:
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and engine.num_requests == 0


def run_engine(engine: LLMEngine, requests: dict[str, tuple]) -> dict[str, object]:
    """Add (prompt, params) per id, step to completion; the final output per id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.block_manager.check_integrity()
    return finished


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The demo model's matrices are tiny: on a shared CPU, intra-op threads only add contention
    (about 10x slower steps here). Restored after this module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Whole-prompt prefill (prefill_first), no prefix caching."""
    llm = LLM(policy="prefill_first", enable_prefix_caching=False, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert all(len(out.token_ids) == 12 and out.finish_reason == "length" for out in outputs)
    assert_all_free(llm.engine)
    return outputs


def handed_off(params: SamplingParams, **token_engine) -> list:
    """Every prompt prefilled by a prompt engine, its KV and first token moved into a token engine
    that decodes the rest (`token_engine`: its overrides); the token engine's outputs in prompt order."""
    prompt_engine = LLMEngine(policy="prompt", prompt_token_budget=128, **ENGINE)
    token_engine = LLMEngine(**{"policy": "token", **ENGINE, **token_engine})
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        prompt_engine.add_request(request_id, prompt, params)
    with pytest.raises(ValueError, match="prefilled"):
        prompt_engine.export_request(ids[0])  # still waiting
    finished, moved, steps = {}, set(), 0
    while len(finished) < len(ids):
        for out in prompt_engine.step():
            assert len(out.token_ids) == 1 and not out.finished
            seq, block_ids = prompt_engine.export_request(out.request_id)
            assert seq.status is SequenceStatus.PREFILLED and seq.num_computed_tokens == len(seq.prompt_token_ids)
            n, src, dst_cache = len(seq.prompt_token_ids), prompt_engine.kv_cache, token_engine.kv_cache
            kv = pack_all(src, slot_index(block_ids, src.block_size, n, src.data.device))
            _, dst = token_engine.reserve_import(out.request_id, seq.prompt_token_ids, seq.params)
            assert len(dst) == len(block_ids)
            unpack_all(dst_cache, slot_index(dst, dst_cache.block_size, n, dst_cache.data.device), kv)
            first = token_engine.complete_import(out.request_id, out.token_ids[0])
            assert first.token_ids == out.token_ids and not first.finished
            prompt_engine.release_request(out.request_id)
            prompt_engine.block_manager.check_integrity()
            moved.add(out.request_id)
        for out in token_engine.step():
            if out.finished:
                finished[out.request_id] = out
        token_engine.block_manager.check_integrity()
        steps += 1
        assert steps < 200
    assert moved == set(ids)
    assert all(finished[i].finish_reason == "length" for i in ids)
    assert_all_free(prompt_engine)
    assert_all_free(token_engine)
    return [finished[i] for i in ids]
