"""`compare_designs.py --capacity`: each design's capacity on the local cluster, measured and
simulated (`splitserve.sim.capacity`): per design, in turn on the same workers, deploy it, measure
its serving overhead and run the real search, take it down; then the simulated searches, on each
design's config, this machine's engine profile (`splitserve profile`, measured once) and the
overhead measured on that design. `--resimulate` runs the simulated searches again from a saved
JSON (its probes, overheads and engine profile), to check a model change without measuring again.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from splitserve.bench.plots import MISSING, cdf_plot, latency_vs_load, plots_available
from splitserve.sim.capacity import PROBE_KEYS, Capacity, CapacitySpec, probe_rows
from splitserve.sim.overhead import ServingOverhead

PROFILE_BATCHES = (1, 2, 4, 8, 16, 32)  # a token worker near capacity batches tens of decodes


def capacity_spec(args) -> CapacitySpec:
    return CapacitySpec(trace=args.trace, length_scale=args.length_scale, max_prompt_tokens=args.max_prompt_tokens,
                        seed=args.seed, tbt_slo_s=args.tbt_slo, ttft_slo_s=args.ttft_slo, rate_low=args.rate_low,
                        rate_high=args.rate_high, iterations=args.iterations, duration_s=args.capacity_duration,
                        min_requests=args.min_requests)


def row(measured: Capacity, simulated: tuple[float, list]) -> dict:
    capacity, (simulated_rps, simulated_probes) = measured.capacity_rps, simulated
    return {"design": measured.name, "capacity_rps": capacity, "simulated_capacity_rps": simulated_rps,
            "simulated_over_measured": simulated_rps / capacity if capacity else None,
            "overhead": dataclasses.asdict(measured.overhead), "max_model_len": measured.max_model_len,
            "probes": probe_rows(measured.name, measured.probes),
            "simulated_probes": probe_rows(f"{measured.name} (simulated)", simulated_probes)}


def load_measured(path: Path) -> tuple[argparse.Namespace, str, list[Capacity], str]:
    """A saved `--capacity --json` file: the arguments it ran with, its hardware, each design's
    measured search (without its requests) and its engine profile (CSV text)."""
    saved = json.loads(path.read_text())
    missing = [key for key in ("args", "hardware", "rows", "engine_profile_csv") if key not in saved]
    missing += [f"rows[{i}].{key}" for i, r in enumerate(saved.get("rows", []))
                for key in ("design", "capacity_rps", "overhead", "max_model_len", "probes") if key not in r]
    if missing:
        raise ValueError(f"{path}: not a compare_designs.py --capacity result, missing {', '.join(missing)}")
    measured = [Capacity(r["design"], r["capacity_rps"],
                         [(p["rate"], {key: p[key] for key in PROBE_KEYS}) for p in r["probes"]],
                         ServingOverhead.from_dict(r["overhead"], f"{path}: {r['design']}'s overhead"),
                         r["max_model_len"], None) for r in saved["rows"]]
    return argparse.Namespace(**saved["args"]), saved["hardware"], measured, saved["engine_profile_csv"]


def draw(rows: list[dict], measured: list[Capacity], out: Path, trace: str) -> list[Path]:
    """Latency against load (every probe, real and simulated) and each design's CDF at its capacity."""
    if not plots_available():
        print(f"no plots: {MISSING}")
        return []
    out.mkdir(parents=True, exist_ok=True)
    probes = [p for r in rows for p in r["probes"] + r["simulated_probes"]]
    paths = [latency_vs_load(probes, out / "capacity_latency_vs_load.png",
                             f"{trace}: latency against load, measured and simulated")]
    for m in measured:
        if m.records_at_capacity:
            paths.append(cdf_plot(m.records_at_capacity, out / f"capacity_cdf_{m.name}.png",
                                  f"{m.name} at its capacity, {m.capacity_rps:.2f} req/s"))
    return paths


def print_rows(rows: list[dict], spec: CapacitySpec, hardware: str) -> None:
    print(f"\nHardware: {hardware}. SLOs: P99 TBT <= {spec.tbt_slo_s * 1000:g} ms, P99 TTFT <= {spec.ttft_slo_s:g} s, "
          f"nothing failed or refused.\n")
    print("| design | capacity (req/s) | simulated (req/s) | simulated / measured | probes |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["simulated_over_measured"]
        print(f"| {r['design']} | {r['capacity_rps']:.2f} | {r['simulated_capacity_rps']:.2f} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} | {len(r['probes'])} |")
