"""What the ingress and the cluster-level scheduler add to a request, against the engine alone.

Side by side, interleaved (A B C A B C ...), the same prompts one at a time:
- engine: `LLMEngine` in this process (one torch thread, like a worker with num_cpus=1), the
  request added and stepped to completion;
- mixed: a splitserve cluster of one mixed worker over HTTP (ingress + CLS + worker actor);
- split: a cluster of one prompt + one token worker (adds the KV reservation and handoff; a
  one-token request runs whole on the prompt worker there, so `--max-tokens 1` times that);
- serve-floor: a Serve HTTP endpoint that answers at once (what Ray Serve itself costs here).
Each cluster is its own Serve app on one local Ray. Reported: p50 / p99 end-to-end latency and
the overhead (cluster minus engine) per mode, plus the controller's placement round trip
(`place` on the CLS actor, as the ingress calls it) timed from this process.

    python scripts/bench_ingress.py --requests 200 --json ingress.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import torch

from splitserve.machine import cpu_name

PROMPTS = ["Tell me about disaggregated serving", "Hello, splitserve", "The KV cache streams layer by layer"]
ENGINE = {"kv_cache_memory_bytes": 64 << 20}
CLUSTERS = {
    "mixed": {"pools": [{"role": "mixed", "num_workers": 1}]},
    "split": {"pools": [{"role": "prompt"}, {"role": "token"}]},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def engine_latency(engine, prompt: str, max_tokens: int, counter: list[int]) -> float:
    from splitserve import SamplingParams

    counter[0] += 1
    start = time.perf_counter()
    engine.add_request(f"r{counter[0]}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def http_latency(http: httpx.Client, url: str, prompt: str, max_tokens: int) -> float:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = http.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def place_round_trips(app: str, n: int) -> list[float]:
    import ray

    from splitserve.cluster.controller import WORKER_NAMESPACE
    from splitserve.placement import PlacementRequest

    handle = ray.get_actor(f"{app}-controller", namespace=WORKER_NAMESPACE)

    async def timed() -> list[float]:
        times = []
        for i in range(n):
            start = time.perf_counter()
            await handle.place.remote(PlacementRequest(f"probe{i}", 8, 1), frozenset({"nobody"}))
            times.append(time.perf_counter() - start)
        return times

    return asyncio.run(timed())


def _floor_app():
    """Ray Serve's own floor on this machine: an HTTP endpoint that answers at once."""
    from fastapi import FastAPI
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Floor:
        @api.post("/v1/completions")
        def complete(self) -> dict:
            return {"choices": [{"text": ""}]}

        @api.get("/health")
        def health(self) -> dict:
            return {"ready": True}

    return Floor.bind()


def start_clusters(port: int) -> dict[str, str]:
    from ray import serve

    from local_ray import start_serve  # this script's folder

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    start_serve(4, port)
    serve.run(_floor_app(), name="serve-floor", route_prefix="/serve-floor", blocking=False)
    urls = {"serve-floor": f"http://127.0.0.1:{port}/serve-floor"}
    wait_until_healthy(urls["serve-floor"], timeout=300)
    for name, config in CLUSTERS.items():
        serve.run(build_app({**config, "engine": ENGINE}), name=name, route_prefix=f"/{name}", blocking=False)
        urls[name] = f"http://127.0.0.1:{port}/{name}"
        wait_until_healthy(urls[name], timeout=300)
    return urls


def measure(args) -> dict:
    from splitserve import LLMEngine

    torch.set_num_threads(1)
    engine, counter = LLMEngine("demo", policy="mixed", **ENGINE), [0]
    urls = start_clusters(args.port)
    samples = {"engine": [], **{name: [] for name in urls}}
    with httpx.Client(timeout=120) as http:
        for name, url in urls.items():  # warm-up
            http_latency(http, url, PROMPTS[0], args.max_tokens)
        for i in range(args.requests):
            prompt = PROMPTS[i % len(PROMPTS)]
            samples["engine"].append(engine_latency(engine, prompt, args.max_tokens, counter))
            for name, url in urls.items():
                samples[name].append(http_latency(http, url, prompt, args.max_tokens))
    place = place_round_trips("split", args.requests)
    _stop_clusters()
    return {"samples": samples, "place": place}


def _stop_clusters() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def summarize(samples: dict[str, list[float]], place: list[float], args) -> dict:
    engine_p50 = statistics.median(samples["engine"])
    rows = []
    for mode, values in samples.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        rows.append({"mode": mode, "requests": len(values), "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
                     "overhead_p50_ms": (p50 - engine_p50) * 1e3 if mode != "engine" else 0.0,
                     "overhead_p99_ms": (p99 - percentile(samples["engine"], 99)) * 1e3 if mode != "engine" else 0.0})
    return {"cpu": cpu_name(), "max_tokens": args.max_tokens, "rows": rows,
            "place_p50_ms": percentile(place, 50) * 1e3, "place_p99_ms": percentile(place, 99) * 1e3}


def print_table(result: dict) -> None:
    print(f"CPU: {result['cpu']}; {result['rows'][0]['requests']} requests each, max_tokens={result['max_tokens']}")
    print("| path | p50 ms | p99 ms | added p50 ms | added p99 ms |\n|---|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['mode']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['overhead_p50_ms']:.2f} | {r['overhead_p99_ms']:.2f} |")
    print(f"placement round trip (CLS actor place call): p50 {result['place_p50_ms']:.2f} ms, "
          f"p99 {result['place_p99_ms']:.2f} ms")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=2,
                        help="2: the first token and one decode (1 never reaches a token worker)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    measured = measure(args)
    result = summarize(measured["samples"], measured["place"], args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
