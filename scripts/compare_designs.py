"""The headline comparison: the same trace at several loads against three designs, brought up in
turn on one local Ray with the same workers (same cores):

- baseline:  mixed workers only, prefill-prioritizing scheduler (vLLM's original; prompts stall decodes)
- sarathi:   mixed workers only, Sarathi-Serve stall-free chunked prefill
- splitwise: a prompt pool and a token pool (KV streamed layer by layer), mixed pool enabled

Unloaded latencies for Table VI slowdowns are measured once, on the first design (the baseline
by default: the reference system, as Splitwise's DGX-A100), and applied to all of them.

    python scripts/compare_designs.py --json compare.json
"""
from __future__ import annotations

import argparse
import asyncio
import json

from splitserve.bench.report import markdown_table
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


def run_design(design: str, args, port: int, baseline, slo) -> tuple[list[dict], object]:
    from ray import serve

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    engine = {"kv_cache_memory_bytes": args.kv_mib << 20, "chunk_token_budget": args.chunk_budget}
    serve.run(build_app(design_config(design, args.workers, engine)), name=design, route_prefix=f"/{design}",
              blocking=False)
    url = f"http://127.0.0.1:{port}/{design}"
    wait_until_healthy(url, timeout=300)
    target = Target(url)
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
    parser.add_argument("--json", help="write one row per design and rate here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.designs = args.designs.split(",")
    unknown = set(args.designs) - set(DESIGNS)
    if unknown:
        parser.error(f"--designs: unknown {sorted(unknown)}; choose from {', '.join(DESIGNS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    import ray
    from ray import serve

    args = parse_args(argv)
    ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    rows, baseline, slo = [], None, SLOSpec()
    try:
        for design in args.designs:
            design_rows, baseline = run_design(design, args, args.port, baseline, slo)
            rows += design_rows
    finally:
        serve.shutdown()
        ray.shutdown()
    hardware = f"{cpu_name()}, {args.workers} workers x 1 CPU, demo model"
    print_table(rows, hardware)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
