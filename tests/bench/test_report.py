import json

import numpy as np
import pytest

from splitserve.bench.report import RequestRecord, markdown_table, percentiles, summarize, write_outputs
from splitserve.bench.slo import Baseline

# Two completed requests, one that broke after its first token, one rejected with 429.
RECORDS = [
    RequestRecord(0, 10, 3, 3, 0.0, 0.5, (0.5, 0.75, 1.0), 1.0),
    RequestRecord(1, 20, 3, 3, 0.5, 1.0, (1.0, 1.0, 1.5), 1.5, status=200),  # 2nd and 1st token in one chunk
    RequestRecord(2, 30, 1, 4, 1.0, 0.75, (0.75,), None, error="stream broke", status=200),
    RequestRecord(3, 40, 0, 4, 1.5, None, (), None, error="rate limited", status=429),
]


def test_tbt_is_the_gaps_between_tokens_and_states_follow_status():
    assert RECORDS[0].tbt_s == (0.25, 0.25)
    assert RECORDS[1].tbt_s == (0.0, 0.5)
    assert RECORDS[3].tbt_s == ()
    assert [r.ok for r in RECORDS] == [True, True, False, False]
    assert [r.rejected for r in RECORDS] == [False, False, False, True]
    assert not RequestRecord(4, 1, 1, 1, 0.0, 0.1, (0.1,), 0.1, status=500).ok


def test_percentiles_interpolate_linearly_like_numpy():
    # sorted [1, 2, 3, 4]: p50 at rank 1.5, p90 at rank 2.7, p99 at rank 2.97
    assert percentiles([4, 1, 3, 2]) == {"p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97),
                                         "mean": 2.5, "max": 4.0}
    values = np.random.default_rng(0).exponential(size=101)
    stats = percentiles(values, qs=(25, 99.9))
    assert list(stats) == ["p25", "p99.9", "mean", "max"]
    assert stats["p99.9"] == pytest.approx(np.percentile(values, 99.9))
    assert stats["p25"] == pytest.approx(np.percentile(values, 25))


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


def test_summarize_counts_throughput_and_latencies():
    summary = summarize(RECORDS, duration_s=2.0)
    assert {k: summary[k] for k in ("num_requests", "num_completed", "num_failed", "num_rejected")} == {
        "num_requests": 4, "num_completed": 2, "num_failed": 1, "num_rejected": 1}
    assert summary["throughput_rps"] == 1.0            # 2 completed / 2 s
    assert summary["output_tokens_per_s"] == 3.0       # (3 + 3) / 2
    assert summary["total_tokens_per_s"] == 18.0       # (10 + 20 + 6) / 2
    assert summary["ttft_s"] == pytest.approx({"p50": 0.75, "p90": 0.95, "p99": 0.995, "mean": 0.75, "max": 1.0})
    # token gaps of completed requests: 0.25 0.25 0.0 0.5 -> sorted 0 .25 .25 .5
    assert summary["tbt_s"] == pytest.approx({"p50": 0.25, "p90": 0.425, "p99": 0.4925, "mean": 0.25, "max": 0.5})
    assert summary["e2e_s"] == pytest.approx({"p50": 1.25, "p90": 1.45, "p99": 1.495, "mean": 1.25, "max": 1.5})
    assert "slo" not in summary
    assert summary["prompt_cached_share"] is None  # no usage said it


def test_the_cached_share_counts_the_completed_requests_whose_usage_said_it():
    said = [RequestRecord(0, 64, 1, 1, 0.0, 0.5, (0.5,), 0.5, cached_tokens=48),
            RequestRecord(1, 32, 1, 1, 0.0, 0.5, (0.5,), 0.5, cached_tokens=0),
            RequestRecord(2, 100, 1, 1, 0.0, 0.5, (0.5,), 0.5),  # a server that does not report it
            RequestRecord(3, 64, 1, 4, 0.0, 0.5, (0.5,), None, error="stream broke", cached_tokens=48)]
    summary = summarize(said, duration_s=1.0)
    assert summary["prompt_cached_share"] == 48 / (64 + 32)
    assert "prefix cache held: 50.0%" in markdown_table(summary)


def test_summarize_with_a_baseline_checks_table_vi():
    # unloaded: TTFT 0.25 s at 10 tokens, 0.5 s at 20 (interpolated), TBT 0.25 s
    slo = summarize(RECORDS, 2.0, baseline=Baseline((10, 30), (0.25, 0.75), 0.25))["slo"]
    assert slo["slowdown"]["ttft"]["p50"] == {"value": 2.0, "bound": 2.0, "met": True}  # 0.5/0.25 and 1.0/0.5
    assert slo["slowdown"]["tbt"]["p50"] == {"value": 1.0, "bound": 1.25, "met": True}  # gaps / 0.25: 0 1 1 2
    assert slo["slowdown"]["tbt"]["p90"] == {"value": pytest.approx(1.7), "bound": 1.5, "met": False}
    # E2E: 1.0 / (0.25 + 2 * 0.25) and 1.5 / (0.5 + 2 * 0.25)
    assert slo["slowdown"]["e2e"]["p50"]["value"] == pytest.approx((4 / 3 + 1.5) / 2)
    assert slo["all_met"] is False
    assert slo["request_attainment"] == 0.0            # both completed ones miss the 1.25x E2E bound


def test_summarize_rejects_a_bad_duration():
    with pytest.raises(ValueError, match="^duration_s: "):
        summarize(RECORDS, 0.0)


def test_markdown_table_lists_percentiles_counts_and_slos():
    summary = summarize(RECORDS, 2.0, baseline=Baseline((10, 30), (0.25, 0.75), 0.25))
    lines = markdown_table(summary).splitlines()
    assert lines[:5] == ["| latency | p50 | p90 | p99 | mean | max |", "|---|---:|---:|---:|---:|---:|",
                         "| TTFT (s) | 0.75 | 0.95 | 0.995 | 0.75 | 1 |",
                         "| TBT (s) | 0.25 | 0.425 | 0.4925 | 0.25 | 0.5 |",
                         "| E2E (s) | 1.25 | 1.45 | 1.495 | 1.25 | 1.5 |"]
    assert "| 4 | 2 | 1 | 1 | 2 | 1 | 3 | 18 |" in lines
    assert "| slowdown | tbt | p90 | 1.7 | 1.5 | no |" in lines
    assert lines[-1] == "All SLOs met: no. Requests within their own bounds: 0.0%."


def test_write_outputs_leaves_every_file(tmp_path):
    summary = summarize(RECORDS, 2.0)
    paths = write_outputs(tmp_path / "run", RECORDS, summary, "demo run")
    assert sorted(paths) == ["latency_cdf", "report", "requests", "summary"]
    rows = [json.loads(line) for line in paths["requests"].read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert rows[1]["tbt_s"] == [0.0, 0.5] and rows[3]["status"] == 429 and rows[2]["e2e_s"] is None
    assert json.loads(paths["summary"].read_text()) == summary
    report = paths["report"].read_text()
    assert report.startswith("# demo run\n") and "| TTFT (s) | 0.75 |" in report and "(latency_cdf.png)" in report
    assert paths["latency_cdf"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_priority_class_is_summarized_as_its_own_records_would_be():
    """`by_priority` from the run's columns (`RunColumns.where`) equals the summary of each class's
    records alone; a run of one class has none."""
    rng = np.random.default_rng(1)
    records = []
    for i in range(60):
        count = int(rng.integers(1, 6))
        times = tuple(np.cumsum(rng.exponential(0.1, count)).tolist())
        status, error = [(200, None), (429, "rate limited"), (200, "stream broke")][i % 7 % 3]
        records.append(RequestRecord(i, 10 + i, count, 5, i * 0.1, times[0], times, times[-1] if error is None
                                     else None, error, status, priority=[0, 3, -1][i % 4 % 3]))
    summary = summarize(records, duration_s=10.0)
    assert list(summary["by_priority"]) == ["-1", "0", "3"]
    for priority, part in summary["by_priority"].items():
        alone = summarize([r for r in records if r.priority == int(priority)], duration_s=10.0)
        assert part == alone
        assert part["num_requests"] == sum(r.priority == int(priority) for r in records)
    assert "by_priority" not in summarize(RECORDS, duration_s=2.0)
    table = markdown_table(summary)
    assert "| priority | requests |" in table and "| 3 | " in table
