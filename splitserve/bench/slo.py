"""Service-level objectives: Splitwise's slowdown SLOs (Table VI), absolute SLOs, and the
Sarathi-Serve capacity search (the highest request rate whose run still meets an SLO).

A slowdown is a latency divided by the same request's latency on an unloaded system (`Baseline`,
measured by a calibration pass that sends one request at a time). Percentile SLOs are checked over
completed requests; failed and rejected requests are counted in `request_attainment` as misses.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from splitserve.jobs import Job, Search, SerialRunner

if TYPE_CHECKING:
    from splitserve.bench.report import RequestRecord

METRICS = ("ttft", "tbt", "e2e")
# Splitwise Table VI: slowdown bounds per metric and percentile (Patel et al., ISCA '24).
TABLE_VI = {
    "ttft": {"p50": 2.0, "p90": 3.0, "p99": 6.0},
    "tbt": {"p50": 1.25, "p90": 1.5, "p99": 5.0},
    "e2e": {"p50": 1.25, "p90": 1.5, "p99": 5.0},
}


@dataclass(frozen=True)
class Baseline:
    """Unloaded latencies: TTFT at measured prompt lengths (piecewise-linear in between, flat
    beyond the ends) and one time between tokens."""

    prompt_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]
    tbt_s: float

    def __post_init__(self):
        if not self.prompt_tokens or len(self.prompt_tokens) != len(self.ttft_s):
            raise ValueError(f"ttft_s: need one TTFT per prompt length (at least one), got {len(self.ttft_s)} "
                             f"for {len(self.prompt_tokens)} lengths")
        if any(b <= a for a, b in zip(self.prompt_tokens, self.prompt_tokens[1:])):
            raise ValueError(f"prompt_tokens: must be strictly increasing, got {self.prompt_tokens}")
        if not all(_positive(t) for t in self.ttft_s):
            raise ValueError(f"ttft_s: every TTFT must be positive, got {self.ttft_s}")
        if not _positive(self.tbt_s):
            raise ValueError(f"tbt_s: must be positive, got {self.tbt_s}")

    def ttft(self, prompt_tokens: int) -> float:
        return float(np.interp(prompt_tokens, self.prompt_tokens, self.ttft_s))

    def e2e(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.ttft(prompt_tokens) + self.tbt_s * (output_tokens - 1)

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> Baseline:
        """From calibration records: the median TTFT per prompt length, the median of all token gaps."""
        done = [r for r in records if r.ok]
        if not done:
            raise ValueError("records: no completed calibration request")
        by_length = defaultdict(list)
        for r in done:
            by_length[r.prompt_tokens].append(r.ttft_s)
        gaps = [gap for r in done for gap in r.tbt_s]
        if not gaps:
            raise ValueError("records: calibration requests need at least 2 output tokens to measure TBT")
        lengths = sorted(by_length)
        return cls(tuple(lengths), tuple(float(np.median(by_length[n])) for n in lengths), float(np.median(gaps)))


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _table_vi() -> dict:
    return {metric: dict(bounds) for metric, bounds in TABLE_VI.items()}


@dataclass(frozen=True)
class SLOSpec:
    """Bounds per metric ("ttft", "tbt", "e2e") and percentile ("p50", "p99.9", ...).
    `slowdown`: multiples of the unloaded latency (Table VI by default; None to skip).
    `absolute`: seconds, e.g. {"ttft": {"p99": 1.0}, "tbt": {"p99": 0.2}}."""

    slowdown: dict | None = field(default_factory=_table_vi)
    absolute: dict | None = None

    def __post_init__(self):
        if self.slowdown is None and self.absolute is None:
            raise ValueError("slowdown/absolute: give at least one set of bounds")
        for name in ("slowdown", "absolute"):
            for metric, bounds in (getattr(self, name) or {}).items():
                _check_bounds(name, metric, bounds)


def _check_bounds(name: str, metric: str, bounds: dict) -> None:
    if metric not in METRICS:
        raise ValueError(f"{name}: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    for key, bound in bounds.items():
        _quantile(key, name)
        if not _positive(bound):
            raise ValueError(f"{name}: the {metric} {key} bound must be positive, got {bound}")


def _quantile(key: str, name: str) -> float:
    """The percentile a bound key names: "p99.9" -> 99.9."""
    try:
        q = float(key[1:]) if key.startswith("p") else math.nan
    except ValueError:
        q = math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"{name}: percentile keys look like 'p50' or 'p99.9' (0-100), got {key!r}")
    return q


def latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds over completed requests: TTFT and E2E per request, TBT per token gap."""
    done = [r for r in records if r.ok]
    return {"ttft": [r.ttft_s for r in done], "tbt": [gap for r in done for gap in r.tbt_s],
            "e2e": [r.e2e_s for r in done]}


def slowdowns(records: Sequence[RequestRecord], baseline: Baseline) -> dict[str, list[float]]:
    """Over completed requests: TTFT / unloaded TTFT and E2E / unloaded E2E per request (at its
    own prompt and output length), and every token gap / unloaded TBT (chunked tokens give zeros)."""
    done = [r for r in records if r.ok]
    return {"ttft": [r.ttft_s / baseline.ttft(r.prompt_tokens) for r in done],
            "tbt": [gap / baseline.tbt_s for r in done for gap in r.tbt_s],
            "e2e": [r.e2e_s / baseline.e2e(r.prompt_tokens, r.output_tokens) for r in done]}


def attainment(records: Sequence[RequestRecord], slo: SLOSpec, baseline: Baseline | None = None) -> dict:
    """Each bound checked: {"slowdown"|"absolute": {metric: {"p99": {"value", "bound", "met"}}}},
    "all_met" (every bound met; no completed request means not met), and "request_attainment":
    the share of all requests (failed and rejected count as misses) that completed with their own
    TTFT and E2E within the tightest bound given for that metric (Table VI: the p50 bounds)."""
    result = {}
    if slo.slowdown is not None:
        if baseline is None:
            raise ValueError("baseline: slowdown SLOs need the unloaded latencies (a calibration pass)")
        result["slowdown"] = _checked(slowdowns(records, baseline), slo.slowdown)
    if slo.absolute is not None:
        result["absolute"] = _checked(latencies(records), slo.absolute)
    result["all_met"] = all(c["met"] for section in result.values() for by_q in section.values() for c in by_q.values())
    attained = sum(_request_attained(r, slo, baseline) for r in records)
    result["request_attainment"] = attained / len(records) if records else None
    return result


def _checked(values: dict[str, list[float]], bounds: dict) -> dict:
    checked = {}
    for metric, by_key in bounds.items():
        checked[metric] = {}
        for key, bound in by_key.items():
            value = float(np.percentile(values[metric], _quantile(key, "slo"))) if values[metric] else None
            checked[metric][key] = {"value": value, "bound": bound, "met": value is not None and value <= bound}
    return checked


def _request_attained(r: RequestRecord, slo: SLOSpec, baseline: Baseline | None) -> bool:
    if not r.ok:
        return False
    own = {"absolute": {"ttft": r.ttft_s, "e2e": r.e2e_s}}
    if slo.slowdown is not None:
        own["slowdown"] = {"ttft": r.ttft_s / baseline.ttft(r.prompt_tokens),
                           "e2e": r.e2e_s / baseline.e2e(r.prompt_tokens, r.output_tokens)}
    for section, values in own.items():
        bounds = getattr(slo, section) or {}
        if any(metric in bounds and value > min(bounds[metric].values()) for metric, value in values.items()):
            return False
    return True


def capacity_search(run_at_rate: Callable[[float], dict], meets: Callable[[dict], bool], low: float, high: float,
                    iterations: int = 6, geometric: bool = False) -> tuple[float, list[tuple[float, dict]]]:
    """`capacity_probes` run here, one after another: the capacity and every (rate, summary) probed."""
    search = capacity_probes(lambda rate: Job(run_at_rate, (rate,)), meets, low, high, iterations, geometric)
    return SerialRunner().drive([search])[0]


def capacity_probes(job_at: Callable[[float], Job], passed: Callable[[Any], bool], low: float, high: float,
                    iterations: int = 6, geometric: bool = False) -> Search:
    """Sarathi-Serve capacity as a search (splitserve.jobs): the highest rate whose probe, the job
    `job_at(rate)`, `passed`. Returns (capacity, every (rate, result) probed, in probe order: 2 +
    iterations at most), so a runner may drive many such searches at once.

    Probes `low` first: if it fails, the capacity is 0.0. Then `high`: if it passes, `high` (the
    capacity may be higher still). Otherwise bisects `iterations` times between the highest
    passing and the lowest failing rate and returns the highest passing one, so the answer is
    within (high - low) / 2**iterations below the true capacity of a monotone system; `geometric`
    bisects at sqrt(low x high) instead, so the answer is within a factor
    (high / low) ** (1 / 2**iterations) of it whatever its size."""
    if not (0 < low < high and math.isfinite(high)):
        raise ValueError(f"low/high: need 0 < low < high, got low={low}, high={high}")
    if iterations < 0:
        raise ValueError(f"iterations: must be at least 0, got {iterations}")
    probes: list[tuple[float, Any]] = []

    def probe(rate: float):
        result = yield job_at(rate)
        probes.append((rate, result))
        return passed(result)

    if not (yield from probe(low)):
        return 0.0, probes
    if (yield from probe(high)):
        return high, probes
    for _ in range(iterations):
        mid = math.sqrt(low * high) if geometric else (low + high) / 2
        low, high = (mid, high) if (yield from probe(mid)) else (low, mid)
    return low, probes


def p99s_within(tbt_s: float, ttft_s: float) -> Callable[[dict], bool]:
    """A `meets` for Sarathi-Serve's capacity: every request completed (none failed or refused),
    P99 TBT at most `tbt_s` and P99 TTFT at most `ttft_s` seconds."""
    def meets(summary: dict) -> bool:
        if summary["num_failed"] or summary["num_rejected"]:
            return False
        tbt, ttft = summary["tbt_s"]["p99"], summary["ttft_s"]["p99"]
        return tbt is not None and ttft is not None and tbt <= tbt_s and ttft <= ttft_s
    return meets


def p99_tbt_within(bound_s: float) -> Callable[[dict], bool]:
    """A `meets` for `capacity_search`: the summary's P99 TBT is at most `bound_s` seconds."""
    def meets(summary: dict) -> bool:
        p99 = summary["tbt_s"]["p99"]
        return p99 is not None and p99 <= bound_s
    return meets
