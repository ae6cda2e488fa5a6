"""Provisioning: Table VI on hand-made records, the bisection, the iso-budget arithmetic, a tiny plan."""
import json
from dataclasses import replace

import pytest

from splitserve.bench.report import RequestRecord
from splitserve.cli import main
from splitserve.placement import Role
from splitserve.provision.search import (
    Goal,
    TraceSpec,
    budget_splits,
    max_throughput,
    meets_slos,
    reference_budget,
    search,
    slowdowns,
    staircase,
)
from splitserve.sim.designs import A100, DESIGNS, design, perf_model
from splitserve.sim.result import SimResult

A = perf_model("llama2-70b", A100)
TTFT0, TBT0 = A.prefill_time(1000), A.decode_time(1, 1000)


def record(index, ttft_x, tbt_x, outputs=3):
    """A request of 1000 prompt tokens whose TTFT and token gaps are multiples of the unloaded A100's."""
    times = [ttft_x * TTFT0 + k * tbt_x * TBT0 for k in range(outputs)]
    return RequestRecord(index, 1000, outputs, outputs, 0.0, times[0], tuple(times), times[-1], status=200)


def result(records):
    return SimResult(tuple(records), (), 10.0, 0, 0)


def test_slowdowns_are_against_the_unloaded_a100():
    values = slowdowns([record(0, 2.0, 1.0)])
    assert values["ttft"] == pytest.approx([2.0])
    # splitwise-sim's per-request TBT: (E2E - TTFT) / output tokens = 2 TBT0 / 3
    assert values["tbt"] == pytest.approx([2 / 3])
    # E2E = 2 TTFT0 + 2 TBT0 over TTFT0 + 2 TBT0
    assert values["e2e"] == pytest.approx([(2 * TTFT0 + 2 * TBT0) / (TTFT0 + 2 * TBT0)])


def test_unloaded_requests_meet_every_bound():
    assert meets_slos(result([record(i, 1.0, 1.0) for i in range(10)]))


@pytest.mark.parametrize("ttft_x, tbt_x", [(2.1, 1.0), (1.0, 1.9)])
def test_a_p50_over_its_bound_fails(ttft_x, tbt_x):
    # TTFT p50 bound 2, TBT p50 bound 1.25 (1.9 x 2 gaps / 3 tokens = 1.27): every request above it
    assert not meets_slos(result([record(i, ttft_x, tbt_x) for i in range(10)]))


def test_tbt_is_each_requests_mean_so_one_stalled_gap_is_averaged():
    # 11 tokens: nine gaps of TBT0 and one stall of 3 TBT0 -> mean 12 TBT0 / 11 = 1.09 (under 1.25)
    times = [TTFT0 + k * TBT0 for k in range(10)] + [TTFT0 + 12 * TBT0]
    stalled = [RequestRecord(i, 1000, 11, 11, 0.0, TTFT0, tuple(times), times[-1], status=200) for i in range(10)]
    assert slowdowns(stalled)["tbt"] == pytest.approx([12 / 11] * 10)
    assert meets_slos(result(stalled))


def test_a_p99_tail_over_its_bound_fails():
    # 98 unloaded + 2 with TTFT slowdown 7 (> p99 bound 6): the p99 lands in the tail
    records = [record(i, 1.0, 1.0) for i in range(98)] + [record(98 + i, 7.0, 1.0) for i in range(2)]
    assert not meets_slos(result(records))
    assert meets_slos(result([record(i, 1.0, 1.0) for i in range(99)] + [record(99, 7.0, 1.0)]))


def test_a_refused_request_fails():
    refused = RequestRecord(1, 1000, 0, 3, 0.0, None, (), None, "full", 429)
    assert not meets_slos(result([record(0, 1.0, 1.0), refused]))


def test_bisection_finds_the_capacity(monkeypatch):
    from splitserve.provision import search
    from splitserve.provision.search import Probe

    def fake_probe(d, p, t, rate, trace):
        return Probe(d.name, p, t, rate, 1, rate <= 37.0)

    monkeypatch.setattr(search, "run_probe", fake_probe)
    seen = []
    # 10 passes, 160 fails; geometric bisection: 40 F, 20 P, sqrt(800) P, sqrt(1131.4) P -> 33.6
    rate = max_throughput(DESIGNS["splitwise-hh"], 1, 1, TraceSpec(), 10.0, 160.0, 4, seen.append)
    assert [p.rate_rps for p in seen] == pytest.approx([10.0, 160.0, 40.0, 20.0, 800 ** 0.5, (800 ** 0.5 * 40) ** 0.5])
    assert rate == pytest.approx((800 ** 0.5 * 40) ** 0.5)
    assert 37.0 / 16 ** (1 / 16) <= rate <= 37.0  # within (high / low) ** (1 / 2**iterations)


def test_iso_budgets_follow_the_summary_formulas():
    assert reference_budget("iso-power") == pytest.approx(1760) and reference_budget("iso-cost") == pytest.approx(190.4)
    assert budget_splits(DESIGNS["baseline-a100"], "iso-power", 1760) == [(70, 0)]
    assert budget_splits(DESIGNS["baseline-a100"], "iso-cost", 190.4) == [(86, 0)]
    assert budget_splits(DESIGNS["baseline-h100"], "iso-power", 1760) == [(40, 0)]
    assert budget_splits(DESIGNS["splitwise-hh"], "iso-power", 1760)[0] == (35, 5)
    assert (55, 15) in budget_splits(DESIGNS["splitwise-aa"], "iso-power", 1760)
    assert (51, 35) in budget_splits(DESIGNS["splitwise-aa"], "iso-cost", 190.4)
    # HA: A100 = int(44 x (40 - 25) // 24.8) = int(660 // 24.8) = 26; HHcap: int(660 // 30.8) = 21
    assert (25, 26) in budget_splits(DESIGNS["splitwise-ha"], "iso-power", 1760)
    assert (25, 21) in budget_splits(DESIGNS["splitwise-hhcap"], "iso-power", 1760)
    # iso-cost HA: int(4.76 x 10 // 2.21) = int(47.6 // 2.21) = 21
    assert (30, 21) in budget_splits(DESIGNS["splitwise-ha"], "iso-cost", 190.4)


def test_a_budget_without_a_split_is_an_error_not_an_empty_plan():
    assert budget_splits(DESIGNS["splitwise-hh"], "iso-power", 88.0, 1) == [(1, 1)]  # 2 H100s at step 1 ...
    with pytest.raises(ValueError, match="budget 88.0 at step 2 leaves no split with both counts >= 1"):
        budget_splits(DESIGNS["splitwise-hh"], "iso-power", 88.0, 2)                # ... but none at step 2
    with pytest.raises(ValueError, match="budget 10.0 at step 5 leaves no machine"):
        budget_splits(DESIGNS["baseline-h100"], "iso-power", 10.0, 5)


def test_plan_mistakes_exit_2_with_the_reason(tmp_path, capsys):
    assert main(["plan", "--design", "splitwise-hh", "--goal", "iso-power", "--budget", "88", "--step", "2",
                 "--serial"]) == 2
    assert "leaves no split with both counts >= 1" in capsys.readouterr().err
    assert main(["plan", "--design", "splitwise-hh", "--goal", "iso-throughput", "--target-rps", "inf",
                 "--serial"]) == 2
    assert "target_rps must be a finite number" in capsys.readouterr().err
    assert main(["plan", "--design", "baseline-h100", "--goal", "iso-power", "--budget", "88", "--serial",
                 "--trace", str(tmp_path / "missing.csv")]) == 2
    assert "trace: no such file" in capsys.readouterr().err


def test_iso_throughput_walks_the_staircase_to_the_cheapest_split():
    # HA at power <= 500 (H100 44, A100 24.8); the target needs p >= 3 and p + t >= 8 (monotone)
    probes = []

    def meets(p, t):
        probes.append((p, t))
        return p >= 3 and p + t >= 8

    best = staircase(DESIGNS["splitwise-ha"], Goal("iso-throughput", 500.0, 1.0, "power", 1), meets)
    # frontier (3, 5) 256, (4, 4) 275.2, (5, 3) 294.4, ...: the cheapest is (3, 5)
    assert (best.num_prompt, best.num_token) == (3, 5) and best.power == pytest.approx(3 * 44 + 5 * 24.8)
    assert best.throughput_rps == 1.0
    # p = 1, 2 fail at their top (t = 18, 16); p = 3 walks down from 14 to 5 (fails at 4); p = 4 and 5
    # start at the last minimum; p = 6 alone (264 + 24.8) already costs more than (3, 5): stop
    assert probes == [(1, 18), (2, 16)] + [(3, t) for t in range(14, 3, -1)] + [(4, 5), (4, 4), (4, 3),
                                                                                  (5, 4), (5, 3), (5, 2)]


def test_iso_throughput_of_a_baseline_is_the_smallest_passing_count():
    probes = []
    best = staircase(DESIGNS["baseline-a100"], Goal("iso-throughput", 300.0, 1.0, "cost", 2),
                     lambda p, t: probes.append((p, t)) or p >= 6)
    assert (best.num_prompt, best.num_token) == (7, 0) and probes == [(1, 0), (3, 0), (5, 0), (7, 0)]
    assert staircase(DESIGNS["splitwise-aa"], Goal("iso-throughput", 5.0, 1.0, "cost", 1), lambda p, t: False) is None


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="design must be"):
        design("nope")
    with pytest.raises(ValueError, match="target_rps"):
        Goal("iso-throughput")
    with pytest.raises(ValueError, match="target_rps must be a finite number"):
        Goal("iso-throughput", target_rps=float("inf"))
    with pytest.raises(ValueError, match="num_token must be 0"):
        DESIGNS["baseline-h100"].scenario(2, 1)
    with pytest.raises(ValueError, match="mixed_policy must be"):
        replace(DESIGNS["baseline-h100"], mixed_policy="token")


def test_mixed_machines_batch_as_the_paper_unless_told_otherwise():
    def policies(scenario):
        return [scenario.policy_for(role) for role in (Role.PROMPT, Role.TOKEN, Role.MIXED)]

    for name in ("baseline-a100", "splitwise-aa"):  # a baseline's machines, a Splitwise mixed pool
        d = DESIGNS[name]
        counts = (3, 0) if d.baseline else (2, 1)
        assert policies(d.scenario(*counts)) == ["prompt", "token", "orca"]
        assert policies(replace(d, mixed_policy="prefill_first").scenario(*counts)) == ["prompt", "token",
                                                                                         "prefill_first"]


def test_a_tiny_plan_end_to_end(tmp_path):
    # 2 H100 + 1 H100 = 132 power units: splits (1, 2) and (2, 1), 5 s of conversation requests
    plan = search(DESIGNS["splitwise-hh"], Goal("iso-power", 132.0, step=1), TraceSpec("conv", 5.0), iterations=2)
    assert [(c.num_prompt, c.num_token) for c in plan.configs] == [(2, 1), (1, 2)]
    assert plan.best is not None and plan.best.throughput_rps > 0
    assert all(c.power == pytest.approx(132.0) for c in plan.configs)
    assert main(["plan", "--design", "baseline-h100", "--goal", "iso-power", "--budget", "88", "--duration-s", "5",
                 "--iterations", "1", "--serial", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["configs"][0]["num_prompt"] == 2 and (tmp_path / "design_space.png").stat().st_size > 0
