"""Token streaming under concurrency: what the serving path costs per token when many requests
stream at once, against the engine alone.

Per round, side by side on one local Ray:
- engine: `LLMEngine` in this process (one torch thread, like a worker with num_cpus=1) decoding
  the same prompts as one batch, stepped to completion;
- cluster: a 1 prompt + 1 token cluster over HTTP, every request streamed at once (`stream: true`).
Reported per round: tokens per second of each and their ratio, the streams' time to first token
and time between chunks (p50 / p99), and the CPU seconds per 1,000 tokens of each process of the
cluster (token worker, ingress, Serve proxy), read from /proc.

    python scripts/bench_streams.py --concurrency 32 --max-tokens 128 --rounds 3 --json streams.json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
import torch

from splitserve.bench.report import write_results_json
from splitserve.machine import cpu_name
from splitserve.sim import host_cpu

ENGINE = {"kv_cache_memory_bytes": 64 << 20}
CLUSTER = {"pools": [{"role": "prompt"}, {"role": "token"}], "engine": ENGINE}
PROCESSES = {"token worker": "ray::Worker", "ingress": "ray::ServeReplica:streams:Ingress", "proxy": "ray::ProxyActor"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def prompts(n: int) -> list[str]:
    return [f"Stream number {i} tells about disaggregated serving" for i in range(n)]


def engine_rate(engine, n: int, max_tokens: int) -> float:
    from splitserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts(n)):
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n * max_tokens / (time.perf_counter() - start)


async def flood(url: str, n: int, max_tokens: int) -> dict:
    """Every prompt streamed at once; per stream its first-chunk time and the gaps between chunks."""
    async with httpx.AsyncClient(timeout=600) as http:
        async def one(prompt: str) -> tuple[float, list[float]]:
            body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            sent, times = time.perf_counter(), []
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            return times[0] - sent, [b - a for a, b in zip(times, times[1:])]

        start = time.perf_counter()
        streams = await asyncio.gather(*(one(p) for p in prompts(n)))
        elapsed = time.perf_counter() - start
    return {"tokens_per_s": n * max_tokens / elapsed, "ttft": [t for t, _ in streams],
            "gaps": [g for _, gaps in streams for g in gaps]}


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role of the cluster spent between two `host_cpu.processes_cpu_s` readings
    (processes alive at both, told apart by Ray's process titles)."""
    spent = dict.fromkeys(PROCESSES, 0.0)
    for pid, (title, cpu_s) in after.items():
        role = next((r for r, prefix in PROCESSES.items() if title.startswith(prefix)), None)
        if role is not None and pid in before:
            spent[role] += cpu_s - before[pid][1]
    return spent


def measure(args) -> list[dict]:
    import ray
    from ray import serve

    from local_ray import serve_cluster  # this script's folder

    from splitserve import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine("demo", policy="mixed", **ENGINE)
    url = serve_cluster(CLUSTER, "streams", args.port)
    asyncio.run(flood(url, args.concurrency, 8))  # warm-up
    rounds = []
    try:
        for _ in range(args.rounds):
            alone = engine_rate(engine, args.concurrency, args.max_tokens)
            before = host_cpu.processes_cpu_s()
            streamed = asyncio.run(flood(url, args.concurrency, args.max_tokens))
            spent = cpu_by_role(before, host_cpu.processes_cpu_s())
            tokens = args.concurrency * args.max_tokens
            rounds.append({
                "engine_tokens_per_s": alone, "cluster_tokens_per_s": streamed["tokens_per_s"],
                "ratio": streamed["tokens_per_s"] / alone,
                "ttft_p50_ms": percentile(streamed["ttft"], 50) * 1e3, "ttft_p99_ms": percentile(streamed["ttft"], 99) * 1e3,
                "gap_p50_ms": percentile(streamed["gaps"], 50) * 1e3, "gap_p99_ms": percentile(streamed["gaps"], 99) * 1e3,
                "cpu_s_per_1k_tokens": {role: spent[role] * 1000 / tokens for role in PROCESSES}})
    finally:
        serve.shutdown()
        ray.shutdown()
    return rounds


def print_table(hardware: str, args, rounds: list[dict], median: float) -> None:
    print(f"CPU: {hardware}; {args.concurrency} streams x {args.max_tokens} tokens, 1 prompt + 1 token worker")
    roles = list(PROCESSES)
    print("| round | engine tok/s | cluster tok/s | ratio | TTFT p50 / p99 ms | chunk gap p50 / p99 ms | "
          + " | ".join(f"{r} CPU s / 1k tok" for r in roles) + " |")
    print("|---" * (6 + len(roles)) + "|")
    for i, r in enumerate(rounds):
        cpu = " | ".join(f"{r['cpu_s_per_1k_tokens'][role]:.3f}" for role in roles)
        print(f"| {i + 1} | {r['engine_tokens_per_s']:.0f} | {r['cluster_tokens_per_s']:.0f} | {r['ratio']:.2f} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} | {cpu} |")
    print(f"median ratio, cluster / engine: {median:.2f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    rounds = measure(args)
    median = statistics.median(r["ratio"] for r in rounds)
    print_table(cpu_name(), args, rounds, median)
    if args.json:
        write_results_json(args.json, cpu_name(), args, rounds, median_ratio=median)
    return {"rows": rounds, "median_ratio": median}


if __name__ == "__main__":
    main()
