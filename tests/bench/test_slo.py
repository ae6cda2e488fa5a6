import pytest

from splitserve.bench.report import RequestRecord
from splitserve.bench.slo import (
    TABLE_VI,
    Baseline,
    SLOSpec,
    attainment,
    capacity_search,
    p99_tbt_within,
    p99s_within,
    slowdowns,
)


def record(prompt, times, error=None, status=200):
    e2e = times[-1] if times and error is None else None
    return RequestRecord(0, prompt, len(times), len(times), 0.0, times[0] if times else None, tuple(times), e2e,
                         error, status)


# completed A (prompt 10) and B (prompt 20), C broke mid-stream, D was rejected
RECORDS = [record(10, (0.5, 0.75, 1.0)), record(20, (1.0, 1.0, 1.5)), record(30, (0.75,), error="reset"),
           record(40, (), error="rate limited", status=429)]
BASELINE = Baseline((10, 30), (0.25, 0.75), 0.25)


def test_baseline_interpolates_ttft_and_builds_e2e():
    baseline = Baseline((100, 300), (0.1, 0.3), 0.02)
    assert baseline.ttft(200) == pytest.approx(0.2)
    assert baseline.ttft(150) == pytest.approx(0.15)
    assert (baseline.ttft(50), baseline.ttft(1000)) == (0.1, 0.3)  # flat beyond the ends
    assert baseline.e2e(200, 11) == pytest.approx(0.2 + 10 * 0.02)
    assert baseline.e2e(100, 1) == 0.1


def test_baseline_from_calibration_records():
    records = [record(100, (0.1, 0.12, 0.15)), record(100, (0.3, 0.31)), record(50, (0.05, 0.09)),
               record(100, (9.0, 9.5), error="reset")]
    baseline = Baseline.from_records(records)
    assert baseline.prompt_tokens == (50, 100)
    assert baseline.ttft_s == pytest.approx((0.05, 0.2))  # median of 0.1 and 0.3; the failed one is ignored
    assert baseline.tbt_s == pytest.approx(0.025)         # median of gaps 0.02 0.03 0.01 0.04


@pytest.mark.parametrize("records, field", [
    ([record(10, (0.1,), error="reset")], "records"), ([record(10, (0.1,))], "records")])
def test_baseline_needs_completed_multi_token_records(records, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        Baseline.from_records(records)


@pytest.mark.parametrize("args, field", [
    (((), (), 0.1), "ttft_s"), (((10, 20), (0.1,), 0.1), "ttft_s"), (((20, 10), (0.1, 0.2), 0.1), "prompt_tokens"),
    (((10,), (0.0,), 0.1), "ttft_s"), (((10,), (0.1,), 0.0), "tbt_s")])
def test_baseline_rejects_bad_values(args, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        Baseline(*args)


def test_slowdowns_divide_by_the_unloaded_latency_of_the_same_request():
    # baseline TTFT: 0.25 at 10 tokens, 0.5 at 20; E2E: 0.25 + 2 * 0.25 = 0.75 and 0.5 + 2 * 0.25 = 1.0
    want = {"ttft": [2.0, 2.0], "tbt": [1.0, 1.0, 0.0, 2.0], "e2e": [1.0 / 0.75, 1.5]}
    got = slowdowns(RECORDS, BASELINE)
    assert got.keys() == want.keys()
    assert all(got[metric] == pytest.approx(values) for metric, values in want.items())


@pytest.mark.parametrize("bound, met", [(2.0, True), (1.99, False)])
def test_attainment_at_the_boundary(bound, met):
    result = attainment(RECORDS, SLOSpec(slowdown={"ttft": {"p50": bound}}), BASELINE)
    assert result["slowdown"] == {"ttft": {"p50": {"value": 2.0, "bound": bound, "met": met}}}
    assert result["all_met"] is met
    assert result["request_attainment"] == (0.5 if met else 0.0)  # A and B of 4 requests


def test_request_attainment_uses_each_metrics_tightest_bound():
    slo = SLOSpec(slowdown={"ttft": {"p50": 2.0}, "e2e": {"p90": 1.4, "p99": 5.0}})
    result = attainment(RECORDS, slo, BASELINE)
    # A: TTFT 2x, E2E 1.33x, within; B: E2E 1.5x > 1.4; C and D did not complete
    assert result["request_attainment"] == 0.25
    assert result["slowdown"]["e2e"]["p90"] == {"value": pytest.approx(4 / 3 + 0.9 * (1.5 - 4 / 3)), "bound": 1.4,
                                                "met": False}
    assert result["all_met"] is False


def test_absolute_slos_need_no_baseline():
    result = attainment(RECORDS, SLOSpec(slowdown=None, absolute={"tbt": {"p99": 0.5}, "ttft": {"p50": 0.75}}))
    assert result["absolute"]["tbt"]["p99"] == {"value": pytest.approx(0.4925), "bound": 0.5, "met": True}
    assert result["absolute"]["ttft"]["p50"] == {"value": 0.75, "bound": 0.75, "met": True}
    assert "slowdown" not in result and result["all_met"] is True
    assert result["request_attainment"] == 0.25  # only A has TTFT <= 0.75 s


def test_no_completed_request_meets_nothing():
    result = attainment(RECORDS[2:], SLOSpec(slowdown=None, absolute={"ttft": {"p99": 100.0}}))
    assert result["absolute"]["ttft"]["p99"] == {"value": None, "bound": 100.0, "met": False}
    assert (result["all_met"], result["request_attainment"]) == (False, 0.0)
    assert attainment([], SLOSpec(), BASELINE)["request_attainment"] is None


def test_slowdown_slos_need_a_baseline():
    with pytest.raises(ValueError, match="^baseline: "):
        attainment(RECORDS, SLOSpec())


def test_default_slo_is_table_vi_and_not_shared():
    spec = SLOSpec()
    assert spec.slowdown == {"ttft": {"p50": 2.0, "p90": 3.0, "p99": 6.0}, "tbt": {"p50": 1.25, "p90": 1.5, "p99": 5.0},
                             "e2e": {"p50": 1.25, "p90": 1.5, "p99": 5.0}}
    assert spec.slowdown is not TABLE_VI and spec.slowdown["ttft"] is not TABLE_VI["ttft"]


@pytest.mark.parametrize("kwargs, field", [
    ({"slowdown": {"itl": {"p50": 1.0}}}, "slowdown"), ({"slowdown": {"ttft": {"99": 1.0}}}, "slowdown"),
    ({"slowdown": {"ttft": {"p101": 1.0}}}, "slowdown"), ({"absolute": {"tbt": {"p99": 0.0}}}, "absolute"),
    ({"slowdown": None}, "slowdown/absolute")])
def test_slo_spec_rejects_bad_bounds(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SLOSpec(**kwargs)


def run_at(rate):
    return {"tbt_s": {"p99": rate / 10}}  # P99 TBT grows with load: meets 0.37 s iff rate <= 3.7


def test_capacity_search_bisects_to_the_highest_passing_rate():
    rate, probes = capacity_search(run_at, p99_tbt_within(0.37), low=1.0, high=5.0)
    assert [r for r, _ in probes] == [1.0, 5.0, 3.0, 4.0, 3.5, 3.75, 3.625, 3.6875]
    assert rate == 3.6875 and probes[-1][1] == {"tbt_s": {"p99": 0.36875}}
    rate, probes = capacity_search(run_at, p99_tbt_within(0.37), low=1.0, high=5.0, iterations=12)
    assert 3.7 - 4 / 2 ** 12 <= rate <= 3.7 and len(probes) == 14


def test_geometric_capacity_search_bisects_in_ratio():
    # 1 P, 16 F; mids sqrt(1 x 16) = 4 F, 2 P, sqrt(8) P, sqrt(sqrt(8) x 4) P
    rate, probes = capacity_search(run_at, p99_tbt_within(0.37), low=1.0, high=16.0, iterations=4, geometric=True)
    assert [r for r, _ in probes] == pytest.approx([1.0, 16.0, 4.0, 2.0, 8 ** 0.5, (8 ** 0.5 * 4) ** 0.5])
    assert 3.7 / 16 ** (1 / 16) <= rate <= 3.7


def test_capacity_search_stops_early_at_either_end():
    assert capacity_search(run_at, p99_tbt_within(0.37), low=4.0, high=8.0) == (0.0, [(4.0, run_at(4.0))])
    rate, probes = capacity_search(run_at, p99_tbt_within(0.37), low=1.0, high=2.0)
    assert (rate, len(probes)) == (2.0, 2)


@pytest.mark.parametrize("kwargs, field", [
    ({"low": 2.0, "high": 1.0}, "low/high"), ({"low": 0.0, "high": 1.0}, "low/high"),
    ({"low": 1.0, "high": 2.0, "iterations": -1}, "iterations")])
def test_capacity_search_rejects_bad_bounds(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        capacity_search(run_at, p99_tbt_within(0.37), **kwargs)


def test_p99_tbt_within_is_inclusive_and_fails_without_data():
    meets = p99_tbt_within(0.2)
    assert meets({"tbt_s": {"p99": 0.2}}) and not meets({"tbt_s": {"p99": 0.21}})
    assert not meets({"tbt_s": {"p99": None}})


def test_p99s_within_needs_both_bounds_and_every_request_served():
    meets = p99s_within(tbt_s=0.05, ttft_s=1.0)
    ok = {"num_failed": 0, "num_rejected": 0, "tbt_s": {"p99": 0.05}, "ttft_s": {"p99": 1.0}}
    assert meets(ok)
    assert not meets({**ok, "tbt_s": {"p99": 0.051}}) and not meets({**ok, "ttft_s": {"p99": 1.01}})
    assert not meets({**ok, "num_failed": 1}) and not meets({**ok, "num_rejected": 1})
    assert not meets({**ok, "ttft_s": {"p99": None}})
