"""`splitserve bench` and `python -m splitserve.bench` (what `ray job submit` runs): replay a
trace against an OpenAI-compatible server and write the results to a folder.

    splitserve bench --url http://127.0.0.1:8000 --trace conv --num-requests 200 --rate 4 --out results/
    splitserve bench --url http://127.0.0.1:8000 --trace mooncake --length-scale 0.05 --out results/  # shared prefixes
    splitserve bench ... --capacity --tbt-slo 0.2 --rate-low 1 --rate-high 16   # Sarathi-Serve capacity
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

import httpx

from splitserve.bench.plots import MISSING, latency_vs_load, plots_available
from splitserve.bench.report import markdown_table, write_outputs
from splitserve.bench.runner import Target, measure_baseline, run_at_rate, run_once
from splitserve.bench.slo import SLOSpec, capacity_search, p99_tbt_within
from splitserve.bench.workload import ARRIVALS, WorkloadSpec, make_workload, parse_priorities
from splitserve.command import report_errors

TRACES = ("code", "conv", "sharegpt", "arxiv", "mooncake", "fixed")
MAX_REQUESTS = 1_000_000  # every request's spec and record is held in memory for the whole run
MAX_SPAN_S = 86_400.0     # a day: a rate whose requests take longer to arrive is a typo, not a benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server's base URL (without /v1), e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", default="conv", help=f"{', '.join(TRACES)}, a CSV file (Azure or length columns) or a Mooncake .jsonl "
                                                   "(prompts share the blocks its hash_ids share)")
    p.add_argument("--num-requests", type=int, default=100, help=f"at most {MAX_REQUESTS:,}")
    p.add_argument("--rate", type=float, default=None, help="mean requests/s (default: the trace's own arrivals), "
                                                            "at which the requests arrive within a day")
    p.add_argument("--arrivals", choices=ARRIVALS, default=None,
                   help="default: the trace's own for code/conv/mooncake without --rate, else poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: CV of inter-arrival times")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths (e.g. 0.125)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=128, help="--trace fixed: prompt length")
    p.add_argument("--output-tokens", type=int, default=128, help="--trace fixed: output length")
    p.add_argument("--session-fraction", type=float, default=1.0,
                   help="trace arrivals with prefix blocks (mooncake): replay this fraction of the conversations, "
                        "every turn of each, instead of consecutive rows")
    p.add_argument("--adapters", default="", help="comma-separated LoRA adapters the requests name as their model "
                   "(loaded on the server), each drawn by its rank's Zipf weight")
    p.add_argument("--adapter-zipf", type=float, default=0.0, help="--adapters: the k-th is drawn with weight "
                   "1 / (k + 1) ** this (0: uniform)")
    p.add_argument("--priority-mix", default="", metavar="P:SHARE,...",
                   help="priority classes: e.g. 0:0.2,1:0.8 sends a fifth of the requests at priority 0, the rest at "
                        "1 (the server needs --scheduling-policy priority); the report gives each class's latencies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", required=True, help="folder for requests.jsonl, summary.json, report.md and plots")
    p.add_argument("--no-calibrate", action="store_true", help="skip the unloaded pass (no Table VI slowdowns)")
    p.add_argument("--ttft-slo", type=float, default=None, help="absolute P99 TTFT SLO, seconds")
    p.add_argument("--tbt-slo", type=float, default=None, help="absolute P99 TBT SLO, seconds (capacity search)")
    p.add_argument("--capacity", action="store_true", help="binary-search the highest rate whose P99 TBT meets --tbt-slo")
    p.add_argument("--rate-low", type=float, default=0.5)
    p.add_argument("--rate-high", type=float, default=16.0)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--no-progress", action="store_true")


def workload_of(args) -> WorkloadSpec:
    return WorkloadSpec(trace=args.trace, num_requests=args.num_requests, rate=args.rate, arrivals=args.arrivals,
                        burstiness=args.burstiness, length_scale=args.length_scale,
                        max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                        fixed_prompt_tokens=args.prompt_tokens, fixed_output_tokens=args.output_tokens, seed=args.seed,
                        session_fraction=args.session_fraction, adapters=adapter_names(args.adapters),
                        adapter_zipf=args.adapter_zipf, priorities=parse_priorities(args.priority_mix))


def adapter_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def slo_of(args) -> SLOSpec | None:
    """Table VI slowdowns unless the unloaded pass is skipped, plus any absolute P99 bounds."""
    absolute = {name: {"p99": bound} for name, bound in (("ttft", args.ttft_slo), ("tbt", args.tbt_slo))
                if bound is not None}
    if args.no_calibrate:
        return SLOSpec(slowdown=None, absolute=absolute) if absolute else None
    return SLOSpec(absolute=absolute or None)


def run(args) -> dict:
    target, workload, slo, out = Target(args.url, args.model, args.api_key), workload_of(args), slo_of(args), Path(args.out)
    # a bad trace, workload, URL or results folder is reported before the server is contacted (capacity: at
    # its first rate)
    _check_load(args)
    make_workload(dataclasses.replace(workload, rate=args.rate_low) if args.capacity else workload)
    if args.capacity and args.tbt_slo is None:
        raise ValueError("--capacity needs --tbt-slo (the P99 TBT bound, seconds)")
    _check_url(args.url)
    out.mkdir(parents=True, exist_ok=True)
    try:
        baseline = None if args.no_calibrate else asyncio.run(measure_baseline(target, workload))
        if args.capacity:
            return _capacity(args, target, workload, slo, baseline, out)
        records, summary = asyncio.run(run_once(target, workload, slo, baseline, not args.no_progress))
    except httpx.HTTPError as error:
        raise RuntimeError(f"cannot talk to {args.url}: {error}") from None
    # the arguments, but the key and the callables a command line sets (`splitserve bench`'s run, make_runner)
    summary["workload"] = {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}
    write_outputs(out, records, summary, f"{args.trace} at {args.rate or 'trace'} req/s")
    print(markdown_table(summary))
    print(f"results in {out}/ (summary.json, requests.jsonl, report.md, plots)")
    return summary


def _check_load(args) -> None:
    """The run fits in memory and in a day at its slowest rate (capacity: --rate-low)."""
    if args.num_requests > MAX_REQUESTS:
        raise ValueError(f"--num-requests must be at most {MAX_REQUESTS:,}, got {args.num_requests:,}")
    flag, rate = ("--rate-low", args.rate_low) if args.capacity else ("--rate", args.rate)
    if rate is None or not rate > 0:  # the trace's own arrivals; or a rate WorkloadSpec refuses
        return
    span = (args.num_requests - 1) / rate  # the last arrival's mean time: the first is at 0
    if span > MAX_SPAN_S:
        raise ValueError(f"{flag} {rate:g}: the last of {args.num_requests:,} requests would arrive after about "
                         f"{span:.3g} s, past {MAX_SPAN_S:g} s (a day); raise {flag} or lower --num-requests")


def _check_url(url: str) -> None:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise ValueError(f"--url {url!r} is not a URL: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url must be an http:// or https:// URL with a host, got {url!r}")


def _capacity(args, target: Target, workload: WorkloadSpec, slo: SLOSpec, baseline, out: Path) -> dict:
    probe = run_at_rate(target, workload, slo, baseline, not args.no_progress)
    best, probes = capacity_search(probe, p99_tbt_within(args.tbt_slo), args.rate_low, args.rate_high, args.iterations)
    rows = [{**summary, "design": "server", "rate": rate} for rate, summary in sorted(probes, key=lambda p: p[0])]
    result = {"capacity_rps": best, "tbt_slo_s": args.tbt_slo, "probes": rows}
    (out / "capacity.json").write_text(json.dumps(result, indent=2))
    if plots_available():
        latency_vs_load(rows, out / "latency_vs_load.png", f"{args.trace}: latency against load")
    else:
        print(f"no latency_vs_load.png: {MISSING}")
    print(f"capacity: {best:.2f} req/s with P99 TBT <= {args.tbt_slo} s ({len(rows)} rates probed); results in {out}/")
    return result


def run_command(args) -> int:
    return report_errors("bench", run, args, (ValueError, RuntimeError, OSError))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_command(parser.parse_args(argv))
