"""Splitwise's provisioning figures from our results, as PNG files (Agg canvas, no pyplot state):
Fig. 16 (latency against load of each provisioned design) and Fig. 18 (throughput, cost and power
of each design relative to Baseline-H100)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from splitserve.bench.plots import latency_vs_load, new_figure
from splitserve.jobs import Job, Runner, SerialRunner
from splitserve.provision.search import TraceSpec
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import Design

RATIOS = (("throughput_ratio", "throughput"), ("cost_ratio", "cost"), ("power_ratio", "power"))


def load_sweep(design: Design, num_prompt: int, num_token: int, trace: TraceSpec, rates: Sequence[float],
               runner: Runner | None = None) -> list:
    """Rows for `latency_vs_load`: the design's cluster simulated at each rate (on `runner`)."""
    return (runner or SerialRunner()).map([Job(load_point, (design, num_prompt, num_token, trace, rate))
                                           for rate in rates])


def load_point(design: Design, num_prompt: int, num_token: int, trace: TraceSpec, rate: float) -> dict:
    summary = simulate(design.scenario(num_prompt, num_token, trace.model), trace.requests(rate)).summary()
    return {"design": design.name, "rate": rate, **{k: summary[k] for k in ("ttft_s", "tbt_s", "e2e_s")}}


def latency_vs_load_figure(rows: Sequence[dict], path: str | Path, trace: str) -> Path:
    """Fig. 16: p50 and p99 TTFT, TBT and E2E of every design against the request rate."""
    return latency_vs_load(rows, path, f"{trace}: latency against load, iso-power clusters (simulated)")


def summary_bars(rows: Sequence[dict], path: str | Path, goal: str = "iso-power") -> Path:
    """Fig. 18: per trace, one group of bars per design (throughput, cost and power over
    Baseline-H100's) for the rows of `goal`."""
    chosen = [r for r in rows if r["goal"] == goal]
    traces = list(dict.fromkeys(r["trace"] for r in chosen))
    if not traces:
        raise ValueError(f"rows: none for goal {goal!r}")
    fig = new_figure(figsize=(7 * len(traces), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(traces)))
    for ax, trace in zip(axes, traces):
        trace_rows = [r for r in chosen if r["trace"] == trace]
        x = np.arange(len(trace_rows))
        for i, (key, label) in enumerate(RATIOS):
            values = [np.nan if r[key] is None else r[key] for r in trace_rows]
            ax.bar(x + (i - 1) * 0.27, values, 0.27, label=label, color=f"C{i}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [r["design"].replace("splitwise-", "sw-") for r in trace_rows], rotation=20)
        ax.set_ylabel("relative to baseline-h100")
        ax.set_title(f"{trace}, {goal}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return Path(path)
