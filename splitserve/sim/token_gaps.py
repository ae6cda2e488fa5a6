"""What each token gap of a run ran beside, so that where a simulation's TBT departs from a real
run's can be read by cause. A request's gaps (between consecutive tokens) fall in one class each,
checked in this order:
- `handoff`: from its first token to its second (on a split cluster the first comes from the
  prompt worker, the second once its KV has landed and the token worker has stepped);
- `landing`: another request's first token came within the gap (its prefill ended; on a split
  cluster its KV landed on the token worker);
- `prefilling`: another request was waiting for its first token during part of the gap;
- `quiet`: nothing else ran but decoding.
A gap's times are its run's own (`start_s` + `token_times_s`): classify one run's records, never
records pooled from runs on different clocks.
"""
from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from splitserve.bench.report import RequestRecord, percentiles

GAP_CLASSES = ("handoff", "landing", "prefilling", "quiet")


def classify_gaps(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Every gap of the requests that got a first token, in seconds, by class."""
    served = [r for r in records if r.ttft_s is not None]
    firsts = sorted(r.start_s + r.ttft_s for r in served)
    windows = sorted((r.start_s, r.start_s + r.ttft_s) for r in served)  # send to first token
    starts = [start for start, _ in windows]
    latest_end = list(itertools.accumulate((end for _, end in windows), max))  # over windows started so far
    gaps: dict[str, list[float]] = {name: [] for name in GAP_CLASSES}
    for record in served:
        times = [record.start_s + t for t in record.token_times_s]
        for index, (a, b) in enumerate(itertools.pairwise(times)):
            if index == 0:
                name = "handoff"
            elif bisect_right(firsts, b) > bisect_right(firsts, a):  # a first token in (a, b]
                name = "landing"
            elif (opened := bisect_left(starts, b)) and latest_end[opened - 1] > a:  # a window meets (a, b)
                name = "prefilling"
            else:
                name = "quiet"
            gaps[name].append(b - a)
    return gaps


def merge_gaps(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    """Add `more`'s gaps (another run's `classify_gaps`) to `into`'s classes."""
    for name in GAP_CLASSES:
        into[name] += more[name]


def gap_summary(gaps: dict[str, list[float]]) -> dict[str, dict]:
    """Per class: how many gaps ("n") and `percentiles` of them (None where there are none)."""
    return {name: {"n": len(values), **percentiles(values)} for name, values in gaps.items()}
