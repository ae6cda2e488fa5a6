"""The prefix cache's host tier (`engine.kv_host_cache_bytes`) on Mooncake's conversation trace,
one engine in this process.

The same requests (every turn of a --session-fraction sample of the trace's conversations, lengths
scaled by --length-scale, the trace's arrival gaps stretched to --rate) replayed at their arrival
times into one engine (the mixed policy: Sarathi-Serve chunks, prefix caching on), three ways:

- device: a KV cache of --kv-mib, nothing kept past it (an evicted prefix is computed again);
- host tier, write-back: the same cache, and --host-mib of host memory keeping what it evicts;
- host tier, write-through: the same, every block copied out once computed (`kv_host_write_policy`);
- device x(1 + host/kv): one cache as large as both, the bound a host tier approaches.

Per setup: P50 / P90 / P99 TTFT and the run's time, the prompt tokens computed and those the
prefix cache served, the tokens restored from host memory. The setups alternate, --repeats times.

    python scripts/bench_host_kv.py --json host-kv.json
"""
from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np
import torch

from splitserve.bench.client import prompt_ids
from splitserve.bench.report import write_results_json
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.machine import cpu_name


def setups(args) -> dict[str, dict]:
    kv, host = args.kv_mib << 20, args.host_mib << 20
    tiers = {f"host tier, {policy.replace('_', '-')}": dict(kv_cache_memory_bytes=kv, kv_host_cache_bytes=host,
                                                             kv_host_write_policy=policy)
             for policy in ("write_back", "write_through")}
    return {"device": dict(kv_cache_memory_bytes=kv), **tiers,
            f"device x{1 + host / kv:g}": dict(kv_cache_memory_bytes=kv + host)}


def workload(args):
    spec = WorkloadSpec(trace="mooncake", num_requests=args.num_requests, rate=args.rate, arrivals="trace",
                        length_scale=args.length_scale, max_prompt_tokens=args.max_prompt_tokens,
                        max_output_tokens=args.max_output_tokens, session_fraction=args.session_fraction,
                        seed=args.seed)
    requests = make_workload(spec)
    return requests, [prompt_ids(r, args.seed) for r in requests]


def replay(engine: LLMEngine, requests, prompts) -> dict:
    """Each request added once its arrival time has passed; the engine stepped until all finish."""
    pending, arrival, ttft, cached = deque(requests), {}, {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(str(r.index), prompts[r.index], params)
            arrival[str(r.index)] = r.arrival_s
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        for out in engine.step():
            if out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - start - arrival[out.request_id]
                cached[out.request_id] = out.num_cached_tokens
    seconds = time.perf_counter() - start
    engine.block_manager.check_integrity()
    prompt_tokens = sum(len(p) for p in prompts)
    q = np.percentile(list(ttft.values()), [50, 90, 99])
    restored = engine.host_tier_tokens[1]
    return {"ttft_s": {"p50": q[0], "p90": q[1], "p99": q[2]}, "seconds": seconds,
            "prompt_tokens_computed": prompt_tokens - sum(cached.values()),
            "prompt_tokens_cached": sum(cached.values()), "tokens_restored": restored}


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    requests, prompts = workload(args)
    rows = []
    for repeat in range(args.repeats):
        for name, overrides in setups(args).items():
            engine = LLMEngine("demo", policy="mixed", max_model_len=args.max_prompt_tokens + args.max_output_tokens,
                               **overrides)
            row = {"setup": name, "repeat": repeat, **replay(engine, requests, prompts)}
            rows.append(row)
            print(f"{name} (repeat {repeat}): TTFT p50 {row['ttft_s']['p50']:.3f} s, p90 {row['ttft_s']['p90']:.3f} s, "
                  f"computed {row['prompt_tokens_computed']}, restored {row['tokens_restored']}", flush=True)
    return rows


def print_rows(rows: list[dict], hardware: str) -> None:
    print(f"\nHardware: {hardware}. Medians over repeats.\n")
    print("| setup | P50 TTFT (s) | P90 TTFT (s) | P99 TTFT (s) | run (s) | prompt tokens computed | "
          "served by the prefix cache | of them restored from host memory |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    names = list(dict.fromkeys(r["setup"] for r in rows))
    for name in names:
        mine = [r for r in rows if r["setup"] == name]
        med = {k: float(np.median([r["ttft_s"][k] for r in mine])) for k in ("p50", "p90", "p99")}
        seconds = float(np.median([r["seconds"] for r in mine]))
        first = mine[0]
        print(f"| {name} | {med['p50']:.3f} | {med['p90']:.3f} | {med['p99']:.3f} | {seconds:.1f} | "
              f"{first['prompt_tokens_computed']} | {first['prompt_tokens_cached']} | {first['tokens_restored']} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200, help="the first rows of the sampled conversations")
    parser.add_argument("--session-fraction", type=float, default=0.025,
                        help="the conversations replayed (every turn of each)")
    parser.add_argument("--seed", type=int, default=0, help="which conversations, and the prompts' tokens")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests/s (the trace's gaps, stretched)")
    parser.add_argument("--length-scale", type=float, default=0.05)
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--kv-mib", type=int, default=24, help="the KV cache")
    parser.add_argument("--host-mib", type=int, default=96, help="the host tier")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write one row per setup and repeat here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    hardware = f"{cpu_name()}, {args.threads} torch thread(s), demo model"
    rows = run(args)
    print_rows(rows, hardware)
    if args.json:
        write_results_json(args.json, hardware, args, rows)
    return rows


if __name__ == "__main__":
    main()
