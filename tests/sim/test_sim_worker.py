"""SimWorker: the engine's policies and block manager stepped in simulated time."""
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from splitserve.cluster.worker_loop import WorkerLoop
from splitserve.engine.policies import SchedulerLimits
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.placement import WorkerLoad
from splitserve.sim.worker import FILLER_TOKEN, SimWorker


@dataclass
class LinearPerf:
    """A constant performance model: prefill costs `prefill_s_per_token` a token, any iteration
    with decodes `decode_s` more. Records every iteration_time call."""

    prefill_s_per_token: float = 0.001
    decode_s: float = 0.02
    calls: list = field(default_factory=list)

    def iteration_time(self, prefill_tokens, decode_seqs, decode_context_tokens, chunk_context):
        self.calls.append((prefill_tokens, decode_seqs, decode_context_tokens, chunk_context))
        return prefill_tokens * self.prefill_s_per_token + (self.decode_s if decode_seqs else 0.0)

    def prefill_time(self, num_tokens):
        return num_tokens * self.prefill_s_per_token

    def decode_time(self, batch, context):
        return self.decode_s


def make_worker(policy="mixed", num_blocks=64, perf=None, **limits):
    times = {}
    worker = SimWorker("w0", policy, perf or LinearPerf(), num_blocks, 16, SchedulerLimits(**limits), times)
    return worker, times


def request(times, seq_id, prompt_tokens, output_tokens):
    times[seq_id] = []
    return Sequence(seq_id, [0] * prompt_tokens, SamplingParams(max_tokens=output_tokens, ignore_eos=True))


def run_until_idle(worker, now=0.0):
    results = []
    while (end := worker.start_iteration(now)) is not None:
        now = end
        results.append(worker.finish_iteration(now))
    return now, results


def test_one_local_request_timeline():
    perf = LinearPerf()
    worker, times = make_worker(perf=perf)
    seq = request(times, "a", 100, 3)
    worker.add(seq, hand_off=False)
    end, results = run_until_idle(worker)
    # prefill 100 tokens: 0.1 s; then two decodes of 0.02 s (contexts 101 and 102)
    assert times["a"] == pytest.approx([0.1, 0.12, 0.14])
    assert end == pytest.approx(0.14)
    assert perf.calls == [(100, 0, 0, 0), (0, 1, 101, 0), (0, 1, 102, 0)]
    assert results[0].first_tokens == (seq,) and results[-1].finished == (seq,)
    assert seq.output_token_ids == [FILLER_TOKEN] * 3 and seq.finish_reason == "length"
    assert (worker.iterations, worker.num_prefills, worker.busy_s) == (3, 1, pytest.approx(0.14))
    assert worker.blocks.num_free_blocks == 64


def test_two_requests_share_iterations():
    perf = LinearPerf()
    worker, times = make_worker(perf=perf)
    for seq_id, prompt in (("a", 100), ("b", 200)):
        worker.add(request(times, seq_id, prompt, 2), hand_off=False)
    run_until_idle(worker)
    # one 300-token prefill (chunk budget 512), then one decode of both (contexts 101 + 201)
    assert perf.calls == [(300, 0, 0, 0), (0, 2, 302, 0)]
    assert times == {"a": pytest.approx([0.3, 0.32]), "b": pytest.approx([0.3, 0.32])}


def test_mixed_chunks_a_long_prompt_alongside_decodes():
    perf = LinearPerf()
    worker, times = make_worker(perf=perf, chunk_token_budget=512)
    worker.add(request(times, "a", 10, 3), hand_off=False)
    worker.start_iteration(0.0)
    worker.finish_iteration(0.01)
    worker.add(request(times, "b", 600, 1), hand_off=False)
    run_until_idle(worker, 0.01)
    # a decodes (1 token of the budget) beside b's first chunk of 511, then b's last 89 (after 511
    # computed: 89 x 511 of chunk context) beside a's decode
    assert perf.calls == [(10, 0, 0, 0), (511, 1, 11, 0), (89, 1, 12, 89 * 511)]


def test_hand_off_frees_the_prompt_side_and_leaves_the_time_to_the_cluster():
    worker, times = make_worker(policy="prompt")
    seq = request(times, "a", 100, 5)
    worker.add(seq, hand_off=True)
    end = worker.start_iteration(0.0)
    result = worker.finish_iteration(end)
    assert result.handed_off == (seq,) and result.first_tokens == (seq,) and result.finished == ()
    assert seq.output_token_ids == [FILLER_TOKEN]
    assert times["a"] == [end]  # the first token goes to the client now; the KV may still travel
    assert worker.blocks.num_free_blocks == 64 and not worker.policy.has_work() and not worker.policy.held
    worker.check_integrity()


def test_import_reserves_then_decodes_from_the_first_token():
    worker, times = make_worker(policy="token")
    seq = request(times, "a", 100, 3)
    worker.reserve_import(seq)
    assert worker.blocks.num_free_blocks == 64 - 7  # ceil(100 / 16)
    assert worker.start_iteration(0.0) is None  # nothing to run while the KV travels
    times["a"].append(0.5)  # the first token, recorded where it was sampled (the prompt worker)
    worker.complete_import("a", FILLER_TOKEN)  # the KV landed at 1.0
    assert seq.status is SequenceStatus.RUNNING
    run_until_idle(worker, 1.0)
    assert times["a"] == pytest.approx([0.5, 1.02, 1.04])
    assert worker.blocks.num_free_blocks == 64


def test_abort_frees_a_reservation():
    worker, times = make_worker(policy="token")
    worker.reserve_import(request(times, "a", 100, 3))
    worker.abort("a")
    assert worker.blocks.num_free_blocks == 64 and not worker.policy.held
    worker.abort("unknown")  # nothing to do


def test_load_is_what_a_real_worker_reports():
    worker, times = make_worker(policy="token")
    worker.reserve_import(request(times, "imp", 100, 3))        # 7 blocks
    worker.add(request(times, "local", 50, 3), hand_off=False)  # waiting: no blocks yet
    expected = WorkerLoad(pending_prompt_tokens=50, decode_tokens=150, num_decoding=2, num_waiting=1,
                          free_kv_tokens=(64 - 7) * 16, total_kv_tokens=64 * 16)
    assert worker.load() == expected
    real = SimpleNamespace(engine=SimpleNamespace(policy=worker.policy, block_manager=worker.blocks,
                                                  config=SimpleNamespace(block_size=16)))
    assert WorkerLoop.load(real) == expected


def test_set_policy_keeps_every_sequence():
    worker, times = make_worker(policy="prompt")
    seq = request(times, "a", 100, 3)
    worker.add(seq, hand_off=False)
    worker.start_iteration(0.0)
    worker.set_policy("mixed")  # mid-iteration, as a pool move may come
    assert worker.policy.name == "mixed" and worker.policy.running == [seq]
    worker.finish_iteration(0.1)
    run_until_idle(worker, 0.1)
    assert times["a"] == pytest.approx([0.1, 0.12, 0.14])
    worker.check_integrity()


def test_changed_tracks_anything_that_moves_the_load():
    worker, times = make_worker()
    worker.changed = False
    worker.add(request(times, "a", 10, 2), hand_off=False)
    assert worker.changed


def test_finish_without_an_iteration_is_an_error():
    worker, _ = make_worker()
    with pytest.raises(RuntimeError, match="no iteration in flight"):
        worker.finish_iteration(0.0)


def test_an_accelgen_worker_takes_its_pivot_time_from_its_model_and_reads_the_simulated_clock():
    now = [0.0]
    worker = SimWorker("w0", "accelgen", LinearPerf(), 64, 16, SchedulerLimits(), {}, clock=lambda: now[0])
    # pivot 512 tokens at 1 ms a token: the budget for a 0.1 s SLO is 100 tokens, floored to 96
    assert worker.policy.time_per_token == pytest.approx(0.001)
    assert worker.policy.token_budget(0.1) == 96
    seq = Sequence("a", [0] * 200, SamplingParams(max_tokens=2, ignore_eos=True, ttft_slo_s=0.1, tbt_slo_s=0.1))
    worker.token_times["a"] = []
    worker.add(seq, hand_off=False)
    end = worker.start_iteration(0.0)  # the first chunk: 96 tokens (its own 0.1 s bounds the budget)
    assert end == pytest.approx(0.096)
    now[0] = end
    worker.finish_iteration(end)
    assert worker.policy.last_token_at == {} and seq.num_computed_tokens == 96
    now[0], _ = run_until_idle(worker, end)
    assert seq.is_finished and len(worker.token_times["a"]) == 2
