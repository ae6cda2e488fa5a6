"""Decode terms fitted by replaying measured groups in the simulator: records made by a cluster of
known terms give those terms back, where a line through requests alone and in pairs does not."""
from dataclasses import replace

import pytest

from splitserve.sim.calibrate import calibrate_decode
from splitserve.sim.cluster import simulate
from splitserve.sim.overhead import ServingOverhead, fit_overhead
from splitserve.sim.serving_profile import measure_serving_overhead
from tests.sim.test_sim_cluster import mixed, spec, split
from tests.sim.test_sim_worker import LinearPerf

TRUTH = ServingOverhead(request_s=0.01, iteration_s=0.002, token_s=0.0015, host_cores=2, request_cpu_s=0.01,
                        stream_cpu_s=0.003)
PROMPTS = (32, 96, 160)


class BatchPerf(LinearPerf):
    """Decode 5 ms plus 0.5 ms a sequence."""

    def iteration_time(self, prefill_tokens, decode_seqs, decode_context_tokens, chunk_context):
        return prefill_tokens * self.prefill_s_per_token + (self.decode_time(decode_seqs, 0) if decode_seqs else 0.0)

    def decode_time(self, batch, context):
        return 0.005 + 0.0005 * batch


def measured(scenario, concurrency=(1, 2, 4, 8)):
    """What a cluster of `TRUTH` gives groups of each concurrency, every prompt size once, sent one
    group at a time (10 s apart: each ends long before the next)."""
    groups = {}
    for c in concurrency:
        specs = [spec(i * c + j, 10.0 * i, prompt, 12) for i, prompt in enumerate(PROMPTS) for j in range(c)]
        records = simulate(replace(scenario, overhead=TRUTH), specs).records
        groups[c] = [records[s.index] for s in specs]
    return groups


@pytest.mark.parametrize("cluster", [mixed(2, perf=BatchPerf()), split(perf=BatchPerf())], ids=["mixed", "split"])
def test_the_replay_recovers_the_terms_that_made_the_records(cluster):
    groups = measured(cluster)
    start = replace(TRUTH, iteration_s=0.0, token_s=0.0)
    fitted = calibrate_decode(cluster, groups, start)
    assert fitted.iteration_s == pytest.approx(TRUTH.iteration_s, rel=0.05)
    assert fitted.token_s == pytest.approx(TRUTH.token_s, rel=0.05)
    assert replace(fitted, iteration_s=0.0, token_s=0.0) == start  # the other terms are left alone


def test_the_first_estimate_misreads_pairs_spread_over_two_workers():
    # JSQ puts a pair on two mixed workers (batch 1 each, sharing the cores with the stack): a line
    # through batch 1 and 2 of one worker finds a per-token cost far from the true one
    cluster = mixed(2, perf=BatchPerf())
    groups = measured(cluster, (1, 2))
    first = fit_overhead(groups[1], groups[2], cluster.perf_models["hw"], cluster.perf_models["hw"])
    assert abs(first.token_s - TRUTH.token_s) > 0.5 * TRUTH.token_s


def test_groups_must_be_whole_and_completed():
    groups = measured(split(perf=BatchPerf()), (1, 2))
    with pytest.raises(ValueError, match="concurrency 2: expected whole groups"):
        calibrate_decode(split(perf=BatchPerf()), {1: groups[1], 2: groups[2][:-1]}, TRUTH)


def test_tokens_that_arrived_in_one_chunk_are_an_error():
    groups = measured(split(perf=BatchPerf()), (1, 2))
    chunked = [replace(r, token_times_s=(r.ttft_s,) * r.output_tokens) for r in groups[2]]
    with pytest.raises(ValueError, match="concurrency 2: the measured median token gap is 0"):
        calibrate_decode(split(perf=BatchPerf()), {1: groups[1], 2: chunked}, TRUTH)


def test_measuring_needs_requests_alone_and_in_pairs(tmp_path):
    with pytest.raises(ValueError, match="concurrency must hold 1 and 2"):
        measure_serving_overhead("http://127.0.0.1:9", None, tmp_path / "engine.csv", (32,), 8, 1,
                                 concurrency=(1, 4))


def test_a_trial_that_overloads_the_simulated_cluster_is_stepped_back_from(monkeypatch):
    # The first step from zero overshoots iteration_s by about 13%. Stand in for a cluster that
    # overloads past 10%: there, its longest prompts are refused (max_model_len below them).
    cluster = split(perf=BatchPerf())
    groups = measured(cluster)
    refused = []

    def overloading(trial, requests):
        if trial.overhead.iteration_s > 1.1 * TRUTH.iteration_s:
            refused.append(trial.overhead.iteration_s)
            trial = replace(trial, max_model_len=max(PROMPTS))
        return simulate(trial, requests)

    monkeypatch.setattr("splitserve.sim.calibrate.simulate", overloading)
    fitted = calibrate_decode(cluster, groups, replace(TRUTH, iteration_s=0.0, token_s=0.0))
    assert refused  # the fit did reach an overloaded trial
    assert fitted.iteration_s == pytest.approx(TRUTH.iteration_s, rel=0.05)
    assert fitted.token_s == pytest.approx(TRUTH.token_s, rel=0.05)


def test_a_first_estimate_the_simulated_cluster_refuses_is_an_error(monkeypatch):
    cluster = split(perf=BatchPerf())
    groups = measured(cluster, (1, 2))
    monkeypatch.setattr("splitserve.sim.calibrate.simulate",
                        lambda trial, requests: simulate(replace(trial, max_model_len=min(PROMPTS)), requests))
    with pytest.raises(ValueError, match="refuses requests of the measured groups at the first estimate"):
        calibrate_decode(cluster, groups, TRUTH)
