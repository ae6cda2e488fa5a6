"""Scoring requests through a split cluster: what evaluation harnesses send (echo, logprobs,
max_tokens 0), whose one token is the prefill's.

A 1 prompt + 1 token cluster of the demo model on one local Ray. Per round, for a short prompt
(one-shot KV) and a long one (past the layer-wise threshold, 512 tokens): `--requests` scoring
requests, `--concurrency` at a time, each prompt new (no prefix hits); then the same while
`--busy` generations of `--busy-tokens`-token prompts (and 200 output tokens) hold the token
worker's KV cache (16,384 tokens) nearly full. Reported per case: requests answered per second, their latency p50 / p99, those
refused (429: no worker could take them), and the pool moves made meanwhile
(`splitserve_pool_transitions_total` from /metrics).

    python scripts/bench_scoring.py --rounds 2 --json scoring.json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.report import write_results_json
from splitserve.machine import cpu_name

ENGINE = {"kv_cache_memory_bytes": 64 << 20}
CLUSTER = {"pools": [{"role": "prompt"}, {"role": "token"}], "engine": ENGINE}
PROMPT_CHARS = {"short": 100, "long": 700}  # the demo model's byte tokenizer: a token a character
BUSY_MAX_TOKENS = 200


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def pool_moves(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "splitserve_pool_transitions_total")


async def score(http: httpx.AsyncClient, url: str, chars: int, n: int, concurrency: int) -> tuple[list[float], int]:
    """Each answered request's seconds, `concurrency` in flight, and how many were refused."""
    gate, seconds, refused = asyncio.Semaphore(concurrency), [], []

    async def one() -> None:
        prompt = f"{uuid.uuid4().hex} ".ljust(chars, "s")
        async with gate:
            sent = time.perf_counter()
            response = await http.post(f"{url}/v1/completions", json={
                "model": "demo", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
            if response.status_code == 429:
                refused.append(1)
                return
            response.raise_for_status()
            seconds.append(time.perf_counter() - sent)

    await asyncio.gather(*(one() for _ in range(n)))
    return seconds, len(refused)


async def warm_up(url: str) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        await score(http, url, 100, 8, 4)


async def generation(http: httpx.AsyncClient, url: str, chars: int) -> None:
    """Generations of `chars`-token prompts one after another until cancelled (its client gone, the
    cluster aborts it); one refused is sent again."""
    while True:
        response = await http.post(f"{url}/v1/completions", json={
            "model": "demo", "prompt": f"{uuid.uuid4().hex} ".ljust(chars, "b"), "max_tokens": BUSY_MAX_TOKENS,
            "ignore_eos": True})
        if response.status_code == 429:
            await asyncio.sleep(0.2)
            continue
        response.raise_for_status()


async def case(url: str, chars: int, args, busy: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        background = [asyncio.ensure_future(generation(http, url, args.busy_tokens)) for _ in range(busy)]
        await asyncio.sleep(3.0 if busy else 0.0)  # their prompts prefilled and sent
        moves_before = pool_moves(url)
        start = time.perf_counter()
        seconds, refused = await score(http, url, chars, args.requests, args.concurrency)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(1.5)  # /metrics has the CLS's counters as of its last poll
        moves = pool_moves(url) - moves_before
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    await asyncio.sleep(2.0)  # the cluster drops the cancelled generations
    return {"answered_per_s": len(seconds) / elapsed, "refused": refused,
            "p50_ms": percentile(seconds, 50) * 1e3 if seconds else None,
            "p99_ms": percentile(seconds, 99) * 1e3 if seconds else None,
            "pool_moves": moves}


def measure(args) -> list[dict]:
    import ray
    from ray import serve

    from local_ray import serve_cluster  # this script's folder

    url = serve_cluster(CLUSTER, "scoring", args.port)
    rows = []
    try:
        asyncio.run(warm_up(url))
        for round_ in range(1, args.rounds + 1):
            for busy in (0, args.busy):
                for size, chars in PROMPT_CHARS.items():
                    row = {"round": round_, "prompt": size, "busy_streams": busy,
                           **asyncio.run(case(url, chars, args, busy))}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="scoring requests per case")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--busy", type=int, default=12, help="generations beside the busy cases")
    parser.add_argument("--busy-tokens", type=int, default=1200, help="the prompt tokens of each of them")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    rows = measure(args)
    print(f"CPU: {cpu_name()}; {args.requests} scoring requests, {args.concurrency} at a time")
    print("| prompt | busy | answered/s | p50 ms | p99 ms | refused | pool moves |\n|---|---:|---:|---:|---:|---:|---:|")
    for size in PROMPT_CHARS:
        for busy in (0, args.busy):
            got = [r for r in rows if r["prompt"] == size and r["busy_streams"] == busy]
            print(f"| {size} | {busy} | " + " | ".join(
                "-" if any(r[key] is None for r in got) else f"{statistics.median(r[key] for r in got):.{digits}f}"
                for key, digits in (("answered_per_s", 1), ("p50_ms", 0), ("p99_ms", 0), ("refused", 0),
                                    ("pool_moves", 0))) + " |")
    if args.json:
        write_results_json(args.json, cpu_name(), args, rows)
    return {"rows": rows}


if __name__ == "__main__":
    main()
