"""splitwise-sim's iteration-time rule: hand-made curves, and the packaged profile read as that simulator reads it."""
import csv
import statistics
from dataclasses import replace

import pytest

from splitserve.sim.designs import A100, DESIGNS, perf_model
from splitserve.sim.perf_model import DEFAULT_PROFILE, PerfModel
from splitserve.sim.splitwise_decode import SplitwiseSimPerf, load_splitwise_sim_models

BASE = PerfModel("m", "hw", 1, (100.0, 200.0), (10.0, 20.0), (1.0, 2.0), (5.0, 6.0), 0.0, 0.0)


def rule(xs=(100.0, 200.0, 400.0), ms=(40.0, 42.0, 50.0)) -> SplitwiseSimPerf:
    return SplitwiseSimPerf(BASE, xs, ms)


def test_decode_reads_the_curve_at_the_number_of_sequences_whatever_their_context():
    model = rule()
    assert model.decode_time(150, 10.0) == model.decode_time(150, 100_000.0) == pytest.approx(0.041)
    # beyond both ends: the end segments extended (40 - 2/100 x 50 = 39; 50 + 8/200 x 100 = 54)
    assert model.decode_time(50, 0.0) == pytest.approx(0.039)
    assert model.decode_time(500, 0.0) == pytest.approx(0.054)


def test_the_unloaded_tbt_reads_the_curve_at_the_prompt_size():
    assert rule().lone_decode_time(300) == pytest.approx(0.046)


def test_iterations_with_prompt_work_use_the_prefill_curve_and_mixing_costs_ten_percent():
    model = rule()
    assert model.iteration_time(150, 0, 0) == pytest.approx(BASE.prefill_time(150))
    assert model.iteration_time(150, 10, 5000) == pytest.approx(1.1 * BASE.prefill_time(160))
    assert model.iteration_time(0, 150, 10**6) == pytest.approx(0.041)


def test_an_extrapolation_to_zero_is_an_error_not_a_free_iteration():
    with pytest.raises(ValueError, match="extrapolates"):
        rule(ms=(10.0, 40.0, 50.0)).decode_time(1, 0.0)
    with pytest.raises(ValueError, match="two points"):
        SplitwiseSimPerf(BASE, (1.0,), (1.0,))


def test_the_packaged_a100_curve_is_the_csv_median_over_prompt_times_batch():
    with DEFAULT_PROFILE.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r["model"], r["hardware"], r["tensor_parallel"]) ==
                ("llama2-70b", A100, "8")]
    at_128 = [float(r["token_time"]) for r in rows if int(r["prompt_size"]) * int(r["batch_size"]) == 128]
    model = load_splitwise_sim_models()["llama2-70b", A100, 8]
    assert model.decode_time(128, 4096.0) == pytest.approx(statistics.median(at_128) / 1000)


def test_under_splitwise_sims_rule_a100_decodes_batch_for_free_and_under_ours_they_do_not():
    ours, theirs = perf_model("llama2-70b", A100), perf_model("llama2-70b", A100, "splitwise-sim")
    # 32 decodes of 1155-token contexts over one such decode alone
    assert theirs.decode_time(32, 1155) / theirs.lone_decode_time(1155) < 1.0
    assert ours.decode_time(32, 1155) / ours.lone_decode_time(1155) > 1.25
    scenario = replace(DESIGNS["splitwise-aa"], decode_rule="splitwise-sim").scenario(1, 1)
    assert isinstance(scenario.perf_models[A100], SplitwiseSimPerf)
    with pytest.raises(ValueError, match="decode_rule"):
        replace(DESIGNS["splitwise-aa"], decode_rule="fast")
