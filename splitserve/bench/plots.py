"""Latency plots as PNG files. Figures are built as `matplotlib.figure.Figure` objects and
rendered by the Agg canvas: no pyplot state, no display needed. matplotlib is the `plots` extra
(`pip install 'splitserve[plots]'`): without it, callers skip their plots (`plots_available`)."""
from __future__ import annotations

import importlib.util
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from splitserve.bench.slo import latencies

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from splitserve.bench.report import RequestRecord

MISSING = "plots need matplotlib: pip install 'splitserve[plots]'"

LOAD_METRICS = (("ttft_s", "TTFT (s)"), ("tbt_s", "TBT (s)"), ("e2e_s", "E2E latency (s)"))
ROW_KEYS = ("design", "rate") + tuple(key for key, _ in LOAD_METRICS)


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def new_figure(**kwargs) -> Figure:
    """A matplotlib Figure (Agg canvas); ImportError naming the extra where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING) from None
    return Figure(**kwargs)


def cdf_plot(records: Sequence[RequestRecord], path: str | Path, title: str) -> Path:
    """Two panels: the CDF of TTFT over completed requests, and of TBT over all their token gaps."""
    values = latencies(records)
    fig = new_figure(figsize=(10, 4), layout="constrained")
    for ax, metric, label in zip(fig.subplots(1, 2), ("ttft", "tbt"), ("TTFT (s)", "TBT (s)")):
        _cdf(ax, values[metric], label)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return Path(path)


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    if values:
        xs = np.sort(values)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    else:
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(label)
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)


def latency_vs_load(rows: Sequence[dict], path: str | Path, title: str) -> Path:
    """One panel per metric (TTFT, TBT, E2E): p50 (solid) and p99 (dashed) against request rate,
    one colour per design. Rows: {"design", "rate", "ttft_s", "tbt_s", "e2e_s"} with each
    metric a `report.percentiles` dict."""
    by_design = _rows_by_design(rows)
    fig = new_figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, len(LOAD_METRICS))
    for ax, (key, label) in zip(axes, LOAD_METRICS):
        for i, (design, design_rows) in enumerate(by_design.items()):
            rates = [row["rate"] for row in design_rows]
            ax.plot(rates, _series(design_rows, key, "p50"), color=f"C{i}", marker="o", label=f"{design} p50")
            ax.plot(rates, _series(design_rows, key, "p99"), color=f"C{i}", marker="x", linestyle="--",
                    label=f"{design} p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return Path(path)


def _rows_by_design(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Rows grouped by design (in first-seen order), each group sorted by rate."""
    if not rows:
        raise ValueError("rows: nothing to plot")
    by_design = defaultdict(list)
    for i, row in enumerate(rows):
        missing = [key for key in ROW_KEYS if key not in row]
        if missing:
            raise ValueError(f"rows: row {i} lacks {', '.join(missing)}")
        by_design[row["design"]].append(row)
    return {design: sorted(group, key=lambda row: row["rate"]) for design, group in by_design.items()}


def _series(rows: list[dict], key: str, stat: str) -> list[float]:
    """One statistic per row; NaN (a gap in the line) where a run had no completed request."""
    return [math.nan if row[key].get(stat) is None else row[key][stat] for row in rows]
