"""Token gaps classed by what else ran (splitserve.sim.token_gaps): hand-made runs whose classes are
read off the timeline, and random runs against the classes' definitions checked pair by pair."""
from __future__ import annotations

import random

import pytest

from splitserve.bench.report import RequestRecord
from splitserve.sim.token_gaps import GAP_CLASSES, classify_gaps, gap_summary, merge_gaps


def record(start: float, times: list[float] | None, index: int = 0) -> RequestRecord:
    """A request sent at `start` whose tokens came at the absolute `times` (None: failed before its first)."""
    if times is None:
        return RequestRecord(index, 8, 0, 4, start, None, (), None, error="boom")
    relative = tuple(t - start for t in times)
    return RequestRecord(index, 8, len(times), len(times), start, relative[0], relative, relative[-1])


def test_each_gap_is_classed_by_what_ran_beside_it():
    a = record(0.0, [1.0, 1.1, 1.2, 1.3, 1.4])
    b = record(1.15, [1.25, 1.5])   # waits for its first token over a's second gap, gets it in a's third
    failed = record(1.32, None)     # no first token: nothing known of its prefill, so a's last gap stays quiet
    gaps = classify_gaps([a, b, failed])
    assert list(gaps) == list(GAP_CLASSES)
    assert gaps["handoff"] == pytest.approx([0.1, 0.25])  # first token to second, a's and b's
    assert gaps["prefilling"] == pytest.approx([0.1])      # (1.1, 1.2): b's wait overlaps it
    assert gaps["landing"] == pytest.approx([0.1])         # (1.2, 1.3]: b's first token at 1.25
    assert gaps["quiet"] == pytest.approx([0.1])           # (1.3, 1.4): a's own wait long over


def test_a_first_token_on_a_gaps_end_lands_in_it_one_on_its_start_does_not():
    a = record(0.0, [0.5, 1.0, 2.0, 3.0])
    on_end = record(0.9, [2.0, 2.5])     # waits over (1.0, 2.0) and lands on its end
    gaps = classify_gaps([a, on_end])
    assert gaps["landing"] == pytest.approx([1.0])    # a's (1.0, 2.0]
    assert gaps["quiet"] == pytest.approx([1.0])      # a's (2.0, 3.0): the first token at 2.0 is its start
    assert gaps["prefilling"] == []


def test_tokens_in_one_chunk_make_a_zero_gap():
    gaps = classify_gaps([record(2.0, [2.1, 2.2, 2.2])])
    assert gaps["handoff"] == pytest.approx([0.1]) and gaps["quiet"] == pytest.approx([0.0])


def _by_definition(records: list[RequestRecord]) -> dict[str, list[float]]:
    served = [r for r in records if r.ttft_s is not None]
    gaps = {name: [] for name in GAP_CLASSES}
    for r in served:
        times = [r.start_s + t for t in r.token_times_s]
        for i in range(1, len(times)):
            a, b = times[i - 1], times[i]
            others = [(o.start_s, o.start_s + o.ttft_s) for o in served]
            if i == 1:
                name = "handoff"
            elif any(a < first <= b for _, first in others):
                name = "landing"
            elif any(start < b and first > a for start, first in others):
                name = "prefilling"
            else:
                name = "quiet"
            gaps[name].append(b - a)
    return gaps


@pytest.mark.parametrize("seed", range(5))
def test_random_runs_match_the_definitions(seed):
    rng = random.Random(seed)
    records = []
    for index in range(40):
        start = rng.uniform(0, 10)
        if rng.random() < 0.1:
            records.append(record(start, None, index))
            continue
        times = [start + rng.uniform(0.05, 0.5)]
        for _ in range(rng.randrange(0, 30)):
            times.append(times[-1] + rng.choice([0.0, rng.uniform(0.001, 0.05)]))
        records.append(record(start, times, index))
    got, expected = classify_gaps(records), _by_definition(records)
    for name in GAP_CLASSES:
        assert sorted(got[name]) == pytest.approx(sorted(expected[name])), name
    assert sum(len(v) for v in got.values()) == sum(len(r.token_times_s) - 1 for r in records if r.ttft_s is not None)


def test_summary_counts_and_percentiles_of_merged_runs():
    pooled = {name: [] for name in GAP_CLASSES}
    merge_gaps(pooled, classify_gaps([record(0.0, [1.0, 1.1, 1.3])]))
    merge_gaps(pooled, classify_gaps([record(0.0, [1.0, 1.2, 1.6])]))  # another run on its own clock
    summary = gap_summary(pooled)
    assert summary["handoff"]["n"] == 2 and summary["handoff"]["p50"] == pytest.approx(0.15)
    assert summary["quiet"]["n"] == 2 and summary["quiet"]["max"] == pytest.approx(0.4)
    assert summary["landing"] == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
