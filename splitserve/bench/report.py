"""Benchmark results: one record per request, a run's summary (latency percentiles, throughput,
SLO attainment) and the files a run leaves behind (requests.jsonl, summary.json, report.md, a PNG).

Latency statistics cover completed requests only; failed and rejected (HTTP 429) requests are
counted separately, and throughput counts completed requests and their tokens.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.bench.plots import MISSING, cdf_plot, plots_available
from splitserve.bench.slo import Baseline, SLOSpec, attainment

LATENCY_ROWS = (("TTFT (s)", "ttft_s"), ("TBT (s)", "tbt_s"), ("E2E (s)", "e2e_s"))


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request."""

    index: int
    prompt_tokens: int
    output_tokens: int                  # tokens received
    requested_output_tokens: int
    start_s: float                      # send time, seconds since run start
    ttft_s: float | None                # None if failed before the first token
    token_times_s: tuple[float, ...]    # every token's arrival, seconds since the request's start (first = ttft)
    e2e_s: float | None
    error: str | None = None
    status: int | None = None           # HTTP status; 429 counts as rejected
    cached_tokens: int | None = None    # prompt tokens the server's prefix cache held (usage's); None: not said
    priority: int = 0                   # the priority it was sent with (RequestSpec's)

    @property
    def tbt_s(self) -> tuple[float, ...]:
        """Gaps between consecutive tokens (zeros where tokens arrived in one chunk)."""
        return tuple(b - a for a, b in itertools.pairwise(self.token_times_s))

    @property
    def rejected(self) -> bool:
        return self.status == 429

    @property
    def ok(self) -> bool:
        """Completed: no error, a 2xx status (or none recorded), and both latencies measured."""
        status_ok = self.status is None or 200 <= self.status < 300
        return self.error is None and status_ok and self.ttft_s is not None and self.e2e_s is not None


@dataclass(frozen=True, eq=False)
class RunColumns:
    """What a run's summary reads of its records, as arrays in record order: a flag and the token
    counts per record, and the latencies of the completed (`ok`) ones, every token gap of each
    in turn in `tbt_s`. A simulation builds them directly, with no `RequestRecord` kept."""

    ok: np.ndarray            # bool, per record
    rejected: np.ndarray      # bool, per record
    prompt_tokens: np.ndarray  # int, per record
    output_tokens: np.ndarray  # int, per record: tokens received
    ttft_s: np.ndarray        # float, per completed record
    e2e_s: np.ndarray         # float, per completed record
    tbt_s: np.ndarray         # float, every gap between tokens of the completed records
    cached_tokens: np.ndarray  # int, per record: prompt tokens the prefix cache held; -1 where not said
    priority: np.ndarray      # int, per record
    tbt_of: np.ndarray        # int, per gap in `tbt_s`: the completed record's place among the completed

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> RunColumns:
        done = [r for r in records if r.ok]
        return cls(np.array([r.ok for r in records], dtype=bool), np.array([r.rejected for r in records], dtype=bool),
                   np.array([r.prompt_tokens for r in records], dtype=np.int64),
                   np.array([r.output_tokens for r in records], dtype=np.int64),
                   np.array([r.ttft_s for r in done], dtype=float), np.array([r.e2e_s for r in done], dtype=float),
                   np.array([gap for r in done for gap in r.tbt_s], dtype=float),
                   np.array([-1 if r.cached_tokens is None else r.cached_tokens for r in records], dtype=np.int64),
                   np.array([r.priority for r in records], dtype=np.int64),
                   np.array([k for k, r in enumerate(done) for _ in r.tbt_s], dtype=np.int64))

    def where(self, keep: np.ndarray) -> RunColumns:
        """The columns of the records `keep` (bool, per record) selects."""
        kept_done = keep[self.ok]
        places = np.cumsum(kept_done) - 1  # a kept completed record's place among the kept ones
        gaps = kept_done[self.tbt_of]
        return RunColumns(self.ok[keep], self.rejected[keep], self.prompt_tokens[keep], self.output_tokens[keep],
                          self.ttft_s[kept_done], self.e2e_s[kept_done], self.tbt_s[gaps], self.cached_tokens[keep],
                          self.priority[keep], places[self.tbt_of[gaps]])

    def cached_share(self) -> float | None:
        """Of the completed requests' prompt tokens, the share the server's prefix cache held, over
        those whose usage said (in a simulation, every one); None when none did."""
        said = self.ok & (self.cached_tokens >= 0)
        prompt = int(self.prompt_tokens[said].sum())
        return int(self.cached_tokens[said].sum()) / prompt if prompt else None


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> dict:
    """{"p50", "p90", "p99", "mean", "max"} (keys follow `qs`: 99.9 -> "p99.9"), percentiles by
    linear interpolation as numpy.percentile's default; every value None when there are none."""
    array = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=float)
    keys = [f"p{q:g}" for q in qs] + ["mean", "max"]
    if not array.size:
        return dict.fromkeys(keys)
    numbers = [*np.percentile(array, qs), array.mean(), array.max()]
    return {key: float(number) for key, number in zip(keys, numbers)}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLOSpec | None = None,
              baseline: Baseline | None = None, columns: RunColumns | None = None) -> dict:
    """Counts, throughput and latency percentiles of a run lasting `duration_s`; where the requests
    were sent with several priorities, the same for each (`by_priority`, by the priority's text,
    lowest first); with `slo` or `baseline` also an "slo" section (`slo.attainment`; Table VI when
    only a baseline is given). `columns`: the records' `RunColumns`, where the caller keeps them
    (else built from `records`)."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s: must be a positive number of seconds, got {duration_s}")
    columns = RunColumns.of(records) if columns is None else columns
    summary = _counts_and_latencies(columns, duration_s)
    classes = np.unique(columns.priority)
    if len(classes) > 1:
        summary["by_priority"] = {str(p): _counts_and_latencies(columns.where(columns.priority == p), duration_s)
                                  for p in classes.tolist()}
    if slo is not None or baseline is not None:
        summary["slo"] = attainment(records, slo or SLOSpec(), baseline)
    return summary


def _counts_and_latencies(columns: RunColumns, duration_s: float) -> dict:
    num_done, num_rejected = int(columns.ok.sum()), int(columns.rejected.sum())
    output_tokens = int(columns.output_tokens[columns.ok].sum())
    return {
        "num_requests": len(columns.ok),
        "num_completed": num_done,
        "num_failed": len(columns.ok) - num_done - num_rejected,
        "num_rejected": num_rejected,
        "duration_s": duration_s,
        "throughput_rps": num_done / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "total_tokens_per_s": (output_tokens + int(columns.prompt_tokens[columns.ok].sum())) / duration_s,
        "ttft_s": percentiles(columns.ttft_s),
        "tbt_s": percentiles(columns.tbt_s),
        "e2e_s": percentiles(columns.e2e_s),
        "prompt_cached_share": columns.cached_share(),
    }


def write_outputs(out_dir: str | Path, records: Sequence[RequestRecord], summary: dict, title: str) -> dict[str, Path]:
    """Write requests.jsonl, summary.json, report.md and latency_cdf.png (where matplotlib is
    installed) under `out_dir` (made if missing); returns their paths by kind: "requests", "summary",
    "report", "latency_cdf"."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"requests": out / "requests.jsonl", "summary": out / "summary.json", "report": out / "report.md",
             "latency_cdf": out / "latency_cdf.png"}
    lines = (json.dumps({**dataclasses.asdict(r), "tbt_s": r.tbt_s}) + "\n" for r in records)
    paths["requests"].write_text("".join(lines))
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    if plots_available():
        cdf_plot(records, paths["latency_cdf"], title)
        figure = f"![TTFT and TBT CDFs]({paths['latency_cdf'].name})"
    else:
        del paths["latency_cdf"]
        figure = f"(no CDF plot: {MISSING})"
    paths["report"].write_text(f"# {title}\n\n{markdown_table(summary)}\n\n{figure}\n")
    return paths


def write_results_json(path: str | Path, hardware: str, args, rows: list[dict], **extra) -> None:
    """A benchmark script's results: the hardware, its arguments (an argparse namespace), its rows
    and any `extra` top-level entries."""
    Path(path).write_text(json.dumps({"hardware": hardware, "args": vars(args), "rows": rows, **extra}, indent=2))


def markdown_table(summary: dict) -> str:
    """The summary as markdown: latency percentiles, then counts and throughput, then SLOs if any."""
    keys = list(summary["ttft_s"])
    lines = ["| latency | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    lines += [f"| {label} | " + " | ".join(_fmt(summary[key][k]) for k in keys) + " |" for label, key in LATENCY_ROWS]
    counts = ("num_requests", "num_completed", "num_failed", "num_rejected", "duration_s", "throughput_rps",
              "output_tokens_per_s", "total_tokens_per_s")
    header = ("| requests | completed | failed | rejected (429) | duration (s) | requests/s | output tokens/s "
              "| total tokens/s |")
    lines += ["", header, "|" + "---:|" * len(counts),
              "| " + " | ".join(_fmt(summary[c]) for c in counts) + " |"]
    if summary["prompt_cached_share"] is not None:
        lines += ["", f"Prompt tokens the server's prefix cache held: {summary['prompt_cached_share']:.1%}."]
    if "by_priority" in summary:
        lines += ["", *_priority_lines(summary["by_priority"])]
    if "slo" in summary:
        lines += ["", *_slo_lines(summary["slo"])]
    return "\n".join(lines)


def _priority_lines(by_priority: dict) -> list[str]:
    """Each priority class's requests and latency percentiles (p50 / p99)."""
    lines = ["| priority | requests | completed | rejected (429) | TTFT p50 / p99 (s) | TBT p50 / p99 (s) "
             "| E2E p50 / p99 (s) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for priority, part in by_priority.items():
        cells = [f"{_fmt(part[key]['p50'])} / {_fmt(part[key]['p99'])}" for _, key in LATENCY_ROWS]
        lines.append(f"| {priority} | {part['num_requests']} | {part['num_completed']} | {part['num_rejected']} | "
                     + " | ".join(cells) + " |")
    return lines


def _slo_lines(slo: dict) -> list[str]:
    lines = ["| SLO | metric | percentile | value | bound | met |", "|---|---|---|---:|---:|---|"]
    for kind in ("slowdown", "absolute"):
        for metric, by_key in slo.get(kind, {}).items():
            lines += [f"| {kind} | {metric} | {key} | {_fmt(c['value'])} | {_fmt(c['bound'])} | {_fmt(c['met'])} |"
                      for key, c in by_key.items()]
    share = slo["request_attainment"]
    within = "-" if share is None else f"{share:.1%}"
    return lines + ["", f"All SLOs met: {_fmt(slo['all_met'])}. Requests within their own bounds: {within}."]


def _fmt(value) -> str:
    """A table cell: 4 significant digits, whole numbers from 1000 up, yes/no, "-" for none."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"
