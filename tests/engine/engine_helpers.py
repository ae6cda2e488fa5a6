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
