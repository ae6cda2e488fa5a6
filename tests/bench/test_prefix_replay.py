"""Replaying a trace with prefix-block ids: the workload scales and clips the blocks with the
prompts, prompt_ids makes shared blocks identical token runs, and a real prefix cache hits them."""
import json

import numpy as np
import pytest

from splitserve.bench.cli import main as bench
from splitserve.bench.client import TOKEN_ID_RANGE, fresh_prompt_seed, prompt_ids
from splitserve.bench.runner import Target
from splitserve.bench.workload import RequestSpec, WorkloadSpec, make_workload
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import one_thread  # noqa: F401 (autouse: one torch thread in this module)

# (timestamp ms, input_length, hash_ids): a system prompt (block 0) and a conversation whose turns
# resend its history (0, 1 -> 0, 1, 2, 3), plus an unrelated request after the system prompt
LINES = [(0, 1000, [0, 1]), (500, 1500, [0, 2, 3]), (2500, 2000, [0, 1, 4, 5])]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 8, "hash_ids": ids}) + "\n"
                            for t, n, ids in LINES))
    return str(path)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_trace_arrivals_lengths_and_blocks(trace):
    requests = make_workload(WorkloadSpec(trace, 3))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [(0.0, 1000, 8), (0.5, 1500, 8),
                                                                                   (2.5, 2000, 8)]
    assert [r.prefix_blocks for r in requests] == [(0, 1), (0, 2, 3), (0, 1, 4, 5)]
    assert {r.block_tokens for r in requests} == {512}
    scaled = make_workload(WorkloadSpec(trace, 3, rate=4.0, arrivals="trace"))
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.1, 0.5])  # mean gap 1/4 s, relative gaps kept
    assert make_workload(WorkloadSpec(trace, 3)) == requests


def test_scaled_and_clipped_prompts_keep_their_shared_prefixes(trace):
    requests = make_workload(WorkloadSpec(trace, 3, length_scale=1 / 16, max_prompt_tokens=100))
    assert [r.prompt_tokens for r in requests] == [62, 94, 100]  # 62.5 (half to even), 93.75, 125 clipped
    assert {r.block_tokens for r in requests} == {32}
    first, second, third = (prompt_ids(r, seed=3) for r in requests)
    assert [len(p) for p in (first, second, third)] == [62, 94, 100]
    assert shared_prefix(first, second) == 32          # block 0
    assert third[:62] == first                         # blocks 0 and 1, all of the first prompt
    assert shared_prefix(third, second) == 32


def test_prompts_sharing_k_blocks_agree_on_exactly_k_blocks():
    spec = RequestSpec(0, 0.0, 200, 1, prefix_blocks=(7, 8, 9, 10), block_tokens=50)
    for k, other_blocks in enumerate([(1, 8, 9), (7, 1, 9), (7, 8, 1), (7, 8, 9, 11)]):
        other = RequestSpec(1, 0.0, 200, 1, prefix_blocks=other_blocks, block_tokens=50)
        a, b = prompt_ids(spec, seed=5), prompt_ids(other, seed=5)
        assert a[:k * 50] == b[:k * 50] and a[k * 50] != b[k * 50]
        assert len(b) == 200 and all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for t in b)
    assert prompt_ids(spec, seed=6)[:50] != prompt_ids(spec, seed=5)[:50]  # the seed picks the blocks' tokens


def test_prompts_past_their_blocks_are_padded_with_the_requests_own_tokens(trace):
    # block tokens round(512 * 0.2) = 102, prompts round(1000 * 0.2) = 200 and round(2000 * 0.2) = 400
    first, _, third = make_workload(WorkloadSpec(trace, 3, length_scale=0.2))
    assert (first.block_tokens, third.prompt_tokens) == (102, 400)  # 4 blocks hold 408
    assert prompt_ids(third, seed=0)[:200] == prompt_ids(first, seed=0)
    padded = RequestSpec(2, 0.0, 410, 1, prefix_blocks=third.prefix_blocks, block_tokens=102)
    assert prompt_ids(padded, seed=0)[:400] == prompt_ids(third, seed=0)
    assert prompt_ids(padded, seed=0)[408:] == prompt_ids(RequestSpec(2, 0.0, 2, 1), seed=0)


def test_prompts_without_blocks_are_the_requests_own():
    spec = RequestSpec(4, 0.0, 30, 1)
    assert prompt_ids(spec, seed=9) == np.random.default_rng([9, 4]).integers(*TOKEN_ID_RANGE, size=30).tolist()


def test_a_real_prefix_cache_hits_the_shared_blocks(trace):
    # block tokens 32 = two engine blocks of 16; the third request shares blocks 0 and 1 with the first
    first, second, third = make_workload(WorkloadSpec(trace, 3, length_scale=1 / 16))
    engine = LLMEngine("demo", enable_prefix_caching=True, device="cpu", dtype="float32", num_kv_blocks=128)
    cached = {}
    for spec in (first, second, third):
        engine.add_request(str(spec.index), prompt_ids(spec, seed=0), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            cached.update((out.request_id, out.num_cached_tokens) for out in engine.step() if out.finished)
    # the second shares block 0 (32 tokens); the third blocks 0 and 1, of which the first request's 62
    # tokens computed three full engine blocks (48 tokens)
    assert cached == {"0": 0, "1": 32, "2": 48}
    engine.block_manager.check_integrity()



def test_a_fresh_prompt_seed_hits_nothing_an_earlier_replay_cached(trace):
    # the same workload replayed on one engine: with the same seed every prompt is served from the
    # cache; with the next run's seed (a capacity probe's) none is, blocks shared within it included
    requests = make_workload(WorkloadSpec(trace, 3, length_scale=1 / 16))
    engine = LLMEngine("demo", enable_prefix_caching=True, device="cpu", dtype="float32", num_kv_blocks=256)

    def cached_tokens(seed):
        cached = 0
        for spec in requests:
            engine.add_request(f"{seed}-{spec.index}", prompt_ids(spec, seed), SamplingParams(max_tokens=1,
                                                                                             ignore_eos=True))
            while engine.has_unfinished_requests():
                cached += sum(out.num_cached_tokens for out in engine.step() if out.finished)
        return cached

    assert fresh_prompt_seed(0, 0) == 0
    first = cached_tokens(0)  # within the run: the blocks the trace shares
    assert first == 32 + 48
    assert cached_tokens(0) == 48 + 80 + 112  # every full engine block of prompts of 62, 94 and 125 tokens
    assert cached_tokens(fresh_prompt_seed(0, 1)) == first
    engine.block_manager.check_integrity()
    # run_once takes each replay's prompt seed from its target's count: the first replay's own, then fresh
    target = Target("http://cluster")
    assert [next(target.replays) for _ in range(3)] == [0, 1, 2] and target == Target("http://cluster")


def test_bench_reports_a_bad_line_before_contacting_the_server(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    assert bench(["--url", "http://127.0.0.1:9", "--trace", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "line 1: missing field hash_ids" in capsys.readouterr().err
