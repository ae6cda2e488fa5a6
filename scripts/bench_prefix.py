"""Prefix-aware against prefix-blind placement on the local cluster, on Mooncake's conversation trace.

The same requests (--num-requests rows of a --session-fraction sample of the trace's conversations,
every turn of each: a window of consecutive rows would cut most conversations, whose turns are
minutes apart; lengths scaled by --length-scale so they fit the demo model, the trace's own arrival
gaps stretched to --rate), the same split cluster (--prompt
prompt and --token token workers, prefix caching on), brought up afresh for each placement so both
start with cold caches:

- aware: `scheduler.prefix_aware: true`: the CLS places each request on the pair that saves the most
  work (cached prefix on the prompt worker, cached prefix on the token worker), and the token worker
  receives only the KV it does not hold;
- blind: `prefix_aware: false`: placement by queue lengths alone, the whole prompt's KV shipped.

Per placement: P50 / P99 TTFT and TBT at the client, and from the cluster's Prometheus counters
(`GET /metrics`, read before and after): prompt tokens the workers computed, KV bytes sent, and the
tokens the token workers reused from their prefix caches instead of receiving. Also the prefill a
single unbounded cache shared by every worker would leave (`prefill_tokens_ideal`): no placement
computes less, so it bounds what prefix-aware placement can save over blind.

    python scripts/bench_prefix.py --json prefix.json
"""
from __future__ import annotations

import argparse
import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.report import markdown_table, write_results_json
from splitserve.bench.runner import Target, run_once
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.config import ClusterConfig
from splitserve.machine import cpu_name

PLACEMENTS = ("aware", "blind")
COUNTERS = {"prefill_tokens_computed": "splitserve_worker_prefill_tokens",
            "kv_bytes_transferred": "splitserve_kv_transfer_bytes",
            "kv_tokens_reused": "splitserve_kv_import_reused_tokens"}


def cluster_config(args, placement: str) -> dict:
    pools = [{"role": "prompt", "num_workers": args.prompt}, {"role": "token", "num_workers": args.token}]
    engine = {"kv_cache_memory_bytes": args.kv_mib << 20, "enable_prefix_caching": True}
    return {"pools": pools, "engine": engine,
            "scheduler": {"policy": "splitwise", "prefix_aware": placement == "aware"}}


def workload(args) -> WorkloadSpec:
    return WorkloadSpec(trace="mooncake", num_requests=args.num_requests, rate=args.rate, arrivals="trace",
                        length_scale=args.length_scale, max_prompt_tokens=args.max_prompt_tokens,
                        session_fraction=args.session_fraction, seed=args.seed)


def ideal_prefill_tokens(args) -> int:
    """The prompt tokens a single unbounded prefix cache shared by every worker would still compute
    for the workload: each prompt less its longest leading run of blocks some earlier prompt had,
    in whole engine blocks and never its last token (as the engine). No placement computes fewer."""
    block_size = ClusterConfig.model_validate(cluster_config(args, "aware")).engine.block_size
    seen, computed = set(), 0
    for request in make_workload(workload(args)):
        chain, cached = request.prefix_blocks, 0
        while cached < len(chain) and chain[:cached + 1] in seen:
            cached += 1
        hit = min(cached * request.block_tokens, request.prompt_tokens - 1) // block_size * block_size
        computed += request.prompt_tokens - hit
        seen.update(chain[:i] for i in range(1, len(chain) + 1))
    return computed


def counters(url: str) -> dict[str, float]:
    """Each of COUNTERS summed over its series (every worker)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    names = {name: key for key, name in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is not None:
            totals[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def run_placement(args, placement: str) -> dict:
    """One placement on a Ray of its own (nothing of the other's cluster left on the cores)."""
    import ray
    from ray import serve

    from local_ray import start_serve  # this script's folder

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    start_serve(args.prompt + args.token + 2, args.port)
    try:
        serve.run(build_app(cluster_config(args, placement)), name=placement, route_prefix=f"/{placement}",
                  blocking=False)
        url = f"http://127.0.0.1:{args.port}/{placement}"
        wait_until_healthy(url, timeout=300)
        before = counters(url)
        _, summary = asyncio.run(run_once(Target(url), workload(args), None, None, not args.no_progress, placement))
        after = counters(url)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{placement}\n{markdown_table(summary)}\n", flush=True)
    quantiles = {key: {q: summary[key][q] for q in ("p50", "p99")} for key in ("ttft_s", "tbt_s")}
    return {"placement": placement, **quantiles, **{k: after[k] - before[k] for k in COUNTERS},
            "num_requests": summary["num_requests"], "num_failed": summary["num_failed"],
            "num_rejected": summary["num_rejected"]}


def print_rows(rows: list[dict], hardware: str, ideal: int) -> None:
    print(f"\nHardware: {hardware}.\n")
    print("| placement | P50 TTFT (s) | P99 TTFT (s) | P50 TBT (ms) | P99 TBT (ms) | prefill tokens computed | "
          "KV MiB sent | KV tokens reused |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['placement']} | {r['ttft_s']['p50']:.3f} | {r['ttft_s']['p99']:.3f} | "
              f"{r['tbt_s']['p50'] * 1000:.1f} | {r['tbt_s']['p99'] * 1000:.1f} | {r['prefill_tokens_computed']:.0f} | "
              f"{r['kv_bytes_transferred'] / 2**20:.1f} | {r['kv_tokens_reused']:.0f} |")
    aware, blind = (next(r for r in rows if r["placement"] == p) for p in PLACEMENTS)
    for key in ("prefill_tokens_computed", "kv_bytes_transferred"):
        if blind[key]:
            print(f"{key}: aware {1 - aware[key] / blind[key]:.0%} fewer than blind")
    if blind["prefill_tokens_computed"]:
        print(f"prefill_tokens_ideal: {ideal} (one unbounded cache shared by every worker), "
              f"{1 - ideal / blind['prefill_tokens_computed']:.0%} fewer than blind")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2, help="prompt workers")
    parser.add_argument("--token", type=int, default=2, help="token workers")
    parser.add_argument("--num-requests", type=int, default=300, help="the first rows of the sampled conversations")
    parser.add_argument("--session-fraction", type=float, default=0.025,
                        help="the conversations replayed (every turn of each); 1: consecutive rows of the trace")
    parser.add_argument("--seed", type=int, default=0, help="which conversations, and the prompts' tokens")
    parser.add_argument("--rate", type=float, default=2.5, help="mean requests/s (the trace's gaps, stretched)")
    parser.add_argument("--length-scale", type=float, default=0.05)
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--kv-mib", type=int, default=64, help="KV cache per worker")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", help="write one row per placement here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    hardware = f"{cpu_name()}, {args.prompt} prompt + {args.token} token workers x 1 CPU, demo model"
    ideal = ideal_prefill_tokens(args)
    rows = [run_placement(args, placement) for placement in PLACEMENTS]
    print_rows(rows, hardware, ideal)
    if args.json:
        write_results_json(args.json, hardware, args, rows, prefill_tokens_ideal=ideal)
    return rows


if __name__ == "__main__":
    main()
