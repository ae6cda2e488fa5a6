"""The headline comparison: the same trace at several loads against three designs, brought up in
turn on one local Ray with the same workers (same cores):

- baseline:  mixed workers only, prefill-prioritizing scheduler (vLLM's original; prompts stall decodes)
- sarathi:   mixed workers only, Sarathi-Serve stall-free chunked prefill
- splitwise: a prompt pool and a token pool (KV streamed layer by layer), mixed pool enabled

Unloaded latencies for Table VI slowdowns are measured once, on the first design (the baseline
by default: the reference system, as Splitwise's DGX-A100), and applied to all of them.

With --capacity it finds each design's capacity instead, measured and simulated (see
design_capacity.py): the highest rate meeting P99 TBT and P99 TTFT SLOs.

    python scripts/compare_designs.py --json compare.json
    python scripts/compare_designs.py --capacity --json capacity.json --out capacity/
    python scripts/compare_designs.py --resimulate capacity.json   # the simulated searches only, again
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from splitserve.bench.report import markdown_table, write_results_json
from splitserve.bench.runner import Target, measure_baseline, run_once
from splitserve.bench.slo import SLOSpec
from splitserve.bench.workload import WorkloadSpec
from splitserve.machine import cpu_name

DESIGNS = ("baseline", "sarathi", "splitwise")
SUMMARY_FIELDS = ("num_requests", "num_failed", "num_rejected", "throughput_rps", "output_tokens_per_s",
                  "ttft_s", "tbt_s", "e2e_s")


def design_config(design: str, workers: int, engine: dict) -> dict:
    if design == "splitwise":
        half = workers // 2
        pools = [{"role": "prompt", "num_workers": half}, {"role": "token", "num_workers": workers - half}]
        return {"pools": pools, "engine": engine, "scheduler": {"policy": "splitwise"}}
    policy = "prefill_first" if design == "baseline" else "mixed"
    return {"pools": [{"role": "mixed", "num_workers": workers}], "engine": {**engine, "mixed_policy": policy},
            "scheduler": {"policy": "jsq"}}


def deploy_design(design: str, args, port: int) -> str:
    """Bring `design` up on the local Serve; its URL once healthy."""
    from ray import serve

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    serve.run(build_app(design_args(design, args)), name=design, route_prefix=f"/{design}", blocking=False)
    url = f"http://127.0.0.1:{port}/{design}"
    wait_until_healthy(url, timeout=300)
    return url


def design_args(design: str, args) -> dict:
    engine = {"kv_cache_memory_bytes": args.kv_mib << 20, "chunk_token_budget": args.chunk_budget}
    return design_config(design, args.workers, engine)


def run_design(design: str, args, port: int, baseline, slo) -> tuple[list[dict], object]:
    from ray import serve

    target = Target(deploy_design(design, args, port))
    if baseline is None:
        baseline = asyncio.run(measure_baseline(target, workload(args, args.rates[0])))
    rows = []
    for rate in args.rates:
        _, summary = asyncio.run(run_once(target, workload(args, rate), slo, baseline, not args.no_progress,
                                          f"{design} @ {rate} req/s"))
        rows.append({"design": design, "rate": rate, **{k: summary[k] for k in SUMMARY_FIELDS},
                     "slo_all_met": summary.get("slo", {}).get("all_met")})
        print(f"{design} @ {rate} req/s\n{markdown_table(summary)}\n", flush=True)
    serve.delete(design)
    return rows, baseline


def workload(args, rate: float) -> WorkloadSpec:
    return WorkloadSpec(trace=args.trace, num_requests=args.num_requests, rate=rate, arrivals="poisson",
                        length_scale=args.length_scale, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed)


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "-"


def print_table(rows: list[dict], hardware: str) -> None:
    print(f"\nHardware: {hardware}. Ratios are against the baseline at the same rate (lower is better).\n")
    print("| rate (req/s) | design | TTFT p50 / p99 (s) | TBT p50 / p99 (s) | E2E p50 / p99 (s) | req/s | "
          "P99 TBT vs baseline | P99 TTFT vs baseline | Table VI met |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    reference = {row["rate"]: row for row in rows if row["design"] == "baseline"}
    for row in sorted(rows, key=lambda r: (r["rate"], DESIGNS.index(r["design"]))):
        ref = reference.get(row["rate"])
        cells = [f"{row[m]['p50']:.3f} / {row[m]['p99']:.3f}" for m in ("ttft_s", "tbt_s", "e2e_s")]
        tbt = ratio(row["tbt_s"]["p99"], ref["tbt_s"]["p99"]) if ref else "-"
        ttft = ratio(row["ttft_s"]["p99"], ref["ttft_s"]["p99"]) if ref else "-"
        met = {True: "yes", False: "no"}.get(row["slo_all_met"], "-")
        print(f"| {row['rate']:g} | {row['design']} | {' | '.join(cells)} | {row['throughput_rps']:.2f} | "
              f"{tbt} | {ttft} | {met} |")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="conv")
    parser.add_argument("--length-scale", type=float, default=0.25, help="the trace's lengths times this (CPU-sized)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--rates", default="2,4,6", help="comma-separated request rates (req/s)")
    parser.add_argument("--workers", type=int, default=2, help="workers per design (one CPU each)")
    parser.add_argument("--chunk-budget", type=int, default=256, help="Sarathi-Serve token budget per iteration")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV cache per worker, MiB")
    parser.add_argument("--designs", default=",".join(DESIGNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("--json", help="write one row per design and rate (--capacity: per design) here")
    parser.add_argument("--no-progress", action="store_true")
    capacity = parser.add_argument_group("--capacity: each design's highest rate within the SLOs, measured and "
                                         "simulated")
    capacity.add_argument("--capacity", action="store_true")
    capacity.add_argument("--tbt-slo", type=float, default=0.05, help="P99 TBT bound, seconds")
    capacity.add_argument("--ttft-slo", type=float, default=1.0, help="P99 TTFT bound, seconds")
    capacity.add_argument("--rate-low", type=float, default=1.0)
    capacity.add_argument("--rate-high", type=float, default=16.0)
    capacity.add_argument("--iterations", type=int, default=4, help="bisection steps after the two ends")
    capacity.add_argument("--capacity-duration", type=float, default=30.0,
                          help="seconds of arrivals per probe (rate x this many requests)")
    capacity.add_argument("--min-requests", type=int, default=40, help="requests per probe at the least")
    capacity.add_argument("--engine-profile", help="a `splitserve profile` CSV of this machine (default: measure one)")
    capacity.add_argument("--overhead-repeats", type=int, default=3,
                          help="runs of each prompt size and concurrency each design's serving overhead is fitted "
                               "on (fewer: measured sooner, noisier)")
    capacity.add_argument("--out", help="a folder for the latency-against-load and CDF plots")
    capacity.add_argument("--resimulate", metavar="JSON", help="a saved --capacity --json result: run only its "
                          "simulated searches again (its probes, overheads, engine profile and arguments; no Ray)")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.designs = args.designs.split(",")
    unknown = set(args.designs) - set(DESIGNS)
    if unknown:
        parser.error(f"--designs: unknown {sorted(unknown)}; choose from {', '.join(DESIGNS)}")
    if args.overhead_repeats < 1:
        parser.error(f"--overhead-repeats must be >= 1, got {args.overhead_repeats}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.resimulate:
        return resimulate_main(args)
    hardware = f"{cpu_name()}, {args.workers} workers x 1 CPU, demo model"
    if args.capacity:
        return capacity_main(args, hardware)
    import ray
    from ray import serve

    from local_ray import start_serve  # this script's folder

    start_serve(args.workers + 2, args.port)
    rows, baseline, slo = [], None, SLOSpec()
    try:
        for design in args.designs:
            design_rows, baseline = run_design(design, args, args.port, baseline, slo)
            rows += design_rows
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(rows, hardware)
    if args.json:
        write_results_json(args.json, hardware, args, rows)
    return rows


def capacity_main(args, hardware: str) -> list[dict]:
    import ray
    from ray import serve

    from design_capacity import PROFILE_BATCHES, capacity_spec, row
    from local_ray import start_serve
    from validate_sim import engine_profile

    from splitserve.config import ClusterConfig
    from splitserve.sim.capacity import measured_capacity, simulated_capacity

    spec = capacity_spec(args)
    configs = {design: ClusterConfig.model_validate(design_args(design, args)) for design in args.designs}
    with tempfile.TemporaryDirectory() as folder:
        profile = engine_profile(args, configs[args.designs[0]], Path(folder), PROFILE_BATCHES)
        start_serve(args.workers + 2, args.port)
        measured = []
        try:
            for design in args.designs:
                url = deploy_design(design, args, args.port)
                measured.append(measured_capacity(design, url, configs[design], profile, spec,
                                                  progress=not args.no_progress,
                                                  overhead_repeats=args.overhead_repeats))
                serve.delete(design)
        finally:
            serve.shutdown()
            ray.shutdown()
        rows = [row(m, simulated_capacity(m, configs[m.name], profile, spec)) for m in measured]
        profile_csv = profile.read_text()
    return report_capacity(args, rows, measured, spec, hardware, profile_csv)


def resimulate_main(args) -> list[dict]:
    from design_capacity import capacity_spec, load_measured, row

    from splitserve.config import ClusterConfig
    from splitserve.sim.capacity import simulated_capacity

    saved_args, hardware, measured, profile_csv = load_measured(Path(args.resimulate))
    spec = capacity_spec(saved_args)
    with tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "engine.csv"
        profile.write_text(profile_csv)
        rows = [row(m, simulated_capacity(m, ClusterConfig.model_validate(design_args(m.name, saved_args)),
                                          profile, spec)) for m in measured]
    saved_args.json, saved_args.out = args.json, args.out
    return report_capacity(saved_args, rows, measured, spec, hardware, profile_csv)


def report_capacity(args, rows: list[dict], measured: list, spec, hardware: str, profile_csv: str) -> list[dict]:
    from design_capacity import draw, print_rows

    print_rows(rows, spec, hardware)
    if args.out:
        for path in draw(rows, measured, Path(args.out), args.trace):
            print(f"wrote {path}")
    if args.json:
        write_results_json(args.json, hardware, args, rows, engine_profile_csv=profile_csv)
    return rows


if __name__ == "__main__":
    main()
