"""Soak test: a local cluster (1 prompt + 1 token worker, demo model) under open-loop streaming load
at about 70% of its measured capacity for N minutes, with hostile-but-valid sampling parameters,
clients that hang up mid-stream, and a worker SIGKILLed every few minutes.

Every request must end answered: completed, or refused or failed with an error (a 4xx/5xx or an
error event in its stream), or hung up by its own client. `lost` counts those that did none of
these (a timeout, a stream cut without an error): it must be 0. At the end every worker's engine
checks its invariants and counts its KV blocks in use (`leaked_blocks`, must be 0), and each
process's resident memory growth is reported: the ingress, the controller and the CLS between the
10% and the 100% marks, and each worker from when it was first seen past the 10% mark (workers
are killed and replaced along the way) to the end; and each one's growth over the second half of
that time (a leak keeps growing; a warm-up levels off). Kills alternate between the prompt and
the token pool. `--kill-controller-every-s` also SIGKILLs the CLS (Serve replaces it, and the new one
adopts the workers): requests refused or failed in the minute after count in
`failed_within_60s_after_a_controller_kill`. `--lora-churn-s` unloads and loads LoRA adapters again
while requests name them (`lora_churn.py`): its loads' and unloads' statuses, and whether every
worker holds what the cluster serves at the end, are reported.

    python scripts/soak.py --minutes 30 --json soak.json
    python scripts/soak.py --minutes 10 --prompt-chunk-tokens 128 --layerwise-threshold 64 --backend ipc
    python scripts/soak.py --minutes 40 --kill-every-s 100000 --trace-memory /tmp/snaps   # where memory grows
    python scripts/soak.py --minutes 4 --kill-every-s 100000 --kill-controller-every-s 60   # the CLS dies
    python scripts/soak.py --minutes 10 --kill-every-s 100 --lora-churn-s 20   # adapters come and go
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import lora_churn  # this script's folder
import memory_trace
from lora_churn import LoraChurn

from splitserve.machine import cpu_name

ENGINE = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024}
HOSTILE = [  # valid requests at the edges of every parameter
    {"temperature": 1e-300}, {"temperature": 2.0, "top_p": 1e-9}, {"temperature": 0.7, "top_k": 1},
    {"temperature": 1.0, "top_k": 10**6, "top_p": 0.999999}, {"seed": 2**64 - 1, "temperature": 1.5},
    {"seed": -2**63, "temperature": 0.3}, {"stop": ["\n", "a", "\x00", "\u2603"], "temperature": 1.0},
    {"stop_token_ids": list(range(64)), "temperature": 1.0}, {"min_tokens": 8, "max_tokens": 8},
    {"ignore_eos": True, "temperature": 0}, {"temperature": 0, "stop": "x" * 256},
]
PROMPTS = ["Hello", "The cluster under load says", "\u00e9\u4e2d\U0001f600 unicode", "x" * 700, "y" * 40]


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()
        self.statuses: Counter = Counter()
        self.refused_at: list[float] = []  # monotonic times of 429s
        self.failed_at: list[float] = []  # monotonic times of refusals (4xx/5xx) and error events
        self.kills_at: list[float] = []
        self.controller_kills_at: list[float] = []
        self.lost_reasons: Counter = Counter()
        self.lost_examples: list[str] = []

    def lost(self, reason: str, example: str) -> None:
        self.outcomes["lost"] += 1
        self.lost_reasons[reason] += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(example[:500])


def request_body(rng: random.Random, model: str) -> tuple[str, dict]:
    params = dict(rng.choice(HOSTILE))
    params.setdefault("max_tokens", rng.randint(1, 48))
    if rng.random() < 0.5:
        return "/v1/completions", {"model": model, "prompt": rng.choice(PROMPTS), "stream": True,
                                   "stream_options": {"include_usage": True}, **params}
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    return "/v1/chat/completions", {"model": model, "messages": messages, "stream": True, **params}


async def one_request(http: httpx.AsyncClient, url: str, path: str, body: dict, hang_up_after: int | None,
                      tally: Tally) -> None:
    try:
        async with http.stream("POST", f"{url}{path}", json=body) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code == 429:
                tally.refused_at.append(time.monotonic())
            if response.status_code != 200:
                await response.aread()
                tally.outcomes["failed_with_error"] += 1
                tally.failed_at.append(time.monotonic())
                return
            events, done, error, last = 0, False, False, ""
            async for event in sse_events(response):
                events, last = events + 1, event
                done = done or event == "[DONE]"
                error = error or (event != "[DONE]" and "error" in json.loads(event))
                if hang_up_after is not None and events >= hang_up_after and not done:
                    tally.outcomes["disconnected"] += 1
                    return
            if done or error:
                tally.outcomes["completed" if done else "failed_with_error"] += 1
                if not done:
                    tally.failed_at.append(time.monotonic())
            else:
                tally.lost("stream ended without [DONE] or an error", f"{path} {json.dumps(body)} last: {last!r}")
    except json.JSONDecodeError as problem:
        tally.lost("JSONDecodeError", f"{path} {json.dumps(body)} {problem}: {problem.doc!r}")
    except httpx.HTTPError as problem:
        tally.lost(type(problem).__name__, f"{path} {json.dumps(body)} {problem!r}")


async def sse_events(response: httpx.Response):
    """The data of each server-sent event. Events end at a blank line and lines at \\n (the SSE
    spec's ends of line, not str.splitlines', which also splits at U+2028 and the like)."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *events, buffer = buffer.split("\n\n")
        for event in events:
            data = [line[6:] for line in event.split("\n") if line.startswith("data: ")]
            if data:
                yield "\n".join(data)


def worker_pids(url: str) -> dict[str, int]:
    import ray

    from splitserve.cluster.controller import WORKER_NAMESPACE

    pids, status = {}, httpx.get(f"{url}/v1/cluster/status", timeout=30)
    for worker_id in status.json()["workers"] if status.status_code == 200 else ():  # not while the CLS is replaced
        try:
            actor = ray.get_actor(f"soak-{worker_id}", namespace=WORKER_NAMESPACE)
            pids[worker_id] = ray.get(actor.info.remote(), timeout=30)["pid"]
        except Exception:  # a worker that just died or is starting
            continue
    return pids


def cluster_processes(url: str) -> dict[str, int]:
    """pid of each worker (by worker id) and of the ingress, controller deployment and CLS actor
    (by their Ray process titles, which stay put while workers come and go)."""
    found = {f"worker {w}": pid for w, pid in worker_pids(url).items()}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(("ray::ServeReplica:soak:", "ray::Controller", "ray::BatchManager")):
            found[title.split(".")[0].removeprefix("ray::")] = int(proc.name)
    return found


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def capacity(http: httpx.AsyncClient, url: str, model: str, seconds: float, concurrency: int = 8) -> float:
    """Completed requests per second with `concurrency` clients sending back to back."""
    rng, tally, deadline = random.Random(1), Tally(), time.monotonic() + seconds

    async def client():
        while time.monotonic() < deadline:
            path, body = request_body(rng, model)
            await one_request(http, url, path, body, None, tally)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tally.outcomes["completed"] / (time.monotonic() - start)


async def load(args, url: str, model: str, rate: float, tally: Tally, marks: dict, churn: LoraChurn | None) -> int:
    rng, tasks, kills = random.Random(args.seed), set(), 0
    start = time.monotonic()
    end, next_kill, ten_percent = start + args.minutes * 60, start + args.kill_every_s, start + args.minutes * 6
    next_cls_kill = start + (args.kill_controller_every_s or math.inf)
    next_churn = start + (args.lora_churn_s or math.inf)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=httpx.Limits(max_connections=512)) as http:
        now = start
        while now < end:
            path, body = request_body(rng, churn.model(rng) if churn else model)
            hang_up = rng.randint(1, 6) if rng.random() < args.disconnect_fraction else None
            task = asyncio.create_task(one_request(http, url, path, body, hang_up, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
            now = time.monotonic()
            if now >= ten_percent and now >= marks.get("next_sample", 0):
                sample = await asyncio.to_thread(cluster_processes, url)
                for name, pid in sample.items():  # from the 10% mark on: each process's resident memory
                    marks.setdefault("rss", {}).setdefault((name, pid), []).append((now, rss_mb(pid)))
                marks["next_sample"] = now + 30
            if now >= next_kill and now < end - 20:
                killed = await asyncio.to_thread(kill_a_worker, url, rng, ("prompt", "token")[kills % 2])
                kills += killed
                tally.kills_at += [time.monotonic()] * killed
                next_kill = now + args.kill_every_s
            if churn is not None and now >= next_churn and now < end - 20:
                task = asyncio.create_task(churn.turn(http, url))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_churn = now + args.lora_churn_s
            if now >= next_cls_kill and now < end - 20:
                tally.controller_kills_at.append(await asyncio.to_thread(kill_the_controller, url))
                next_cls_kill = now + args.kill_controller_every_s
        await asyncio.gather(*tasks)
    return kills


def kill_a_worker(url: str, rng: random.Random, role: str) -> int:
    """SIGKILLs one of the `role` pool's workers (any worker when none of them is up)."""
    pids = worker_pids(url)
    if not pids:
        return 0
    worker_id = rng.choice(sorted(w for w in pids if w.startswith(role)) or sorted(pids))
    os.kill(pids[worker_id], signal.SIGKILL)
    print(f"soak: SIGKILL worker {worker_id} (pid {pids[worker_id]})", flush=True)
    return 1


def kill_the_controller(url: str) -> float:
    """SIGKILLs the CLS actor's process; when it died (monotonic)."""
    pid = cluster_processes(url)["Controller"]
    os.kill(pid, signal.SIGKILL)
    print(f"soak: SIGKILL the CLS (pid {pid})", flush=True)
    return time.monotonic()


def rss_growth(samples: list[tuple[float, float | None]], end: float, end_mb: float) -> dict:
    """A process's resident growth from its first sample to the end, and over the second half of
    that time alone (from the sample nearest its middle): a leak keeps growing, a warm-up levels off."""
    (since, first_mb), middle = samples[0], (samples[0][0] + end) / 2
    mid_at, mid_mb = min(samples, key=lambda sample: abs(sample[0] - middle))
    return {"mb": round(end_mb - first_mb, 1),
            "second_half_mb": round(end_mb - mid_mb, 1) if mid_mb is not None else None,
            "second_half_min": round((end - mid_at) / 60, 1), "rss_mb": round(end_mb, 1),
            "over_min": round((end - since) / 60, 1)}


def growth_by_process(samples_of: dict, end: float, end_pids: dict[str, int], trace_dir: str | None):
    """Each process still up at `end` (monotonic): its resident growth (`rss_growth`), and with
    `trace_dir` what its own records say grew over the same second half."""
    growth, traces, unix_offset = {}, {}, time.time() - time.monotonic()
    for (name, pid), samples in samples_of.items():
        end_mb = rss_mb(pid) if end_pids.get(name) == pid else None
        if end_mb is not None and samples[0][1] is not None:
            growth[name] = rss_growth(samples, end, end_mb)
            if trace_dir:
                traces[name] = memory_trace.memory_growth(trace_dir, pid, unix_offset + (samples[0][0] + end) / 2)
    return growth, traces


def leaked_blocks(url: str, timeout: float = 120) -> dict[str, int]:
    """KV blocks each worker holds once the load is over (after replacements have come up)."""
    import ray

    from splitserve.cluster.controller import WORKER_NAMESPACE

    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{url}/v1/cluster/status", timeout=30).json()
        held = {}
        for worker_id in state["workers"]:
            actor = ray.get_actor(f"soak-{worker_id}", namespace=WORKER_NAMESPACE)
            held[worker_id] = ray.get(actor.check_integrity.remote(), timeout=30)["blocks_used"]
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(1)


def counter_total(url: str, name: str) -> float:
    """A counter summed over its series, from the cluster's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}{{"))


def cluster_config(args) -> dict:
    """The soaked cluster: the demo model on one prompt and one token worker (the default pools)."""
    engine = {**ENGINE, **({"prompt_chunk_tokens": args.prompt_chunk_tokens} if args.prompt_chunk_tokens else {}),
              **(lora_churn.ENGINE if args.lora_churn_s else {})}
    return {"engine": engine, "transfer": {"backend": args.backend, "timeout_s": 20, "lease_s": 60,
                                           "layerwise_threshold": args.layerwise_threshold},
            "scheduler": {"report_interval_s": 0.05}}


def main(argv: list[str] | None = None) -> dict:
    import ray
    from ray import cloudpickle, serve

    from local_ray import start_serve  # this script's folder

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    args = parse_args(argv)
    runtime_env = {}
    if args.trace_memory:
        cloudpickle.register_pickle_by_value(memory_trace)  # its hook runs in workers, which cannot import it
        Path(args.trace_memory).mkdir(parents=True, exist_ok=True)
        runtime_env["worker_process_setup_hook"] = memory_trace.setup_hook(
            str(Path(args.trace_memory).resolve()), args.trace_every_s, args.trace_frames)
    start_serve(4, args.port, runtime_env=runtime_env)
    config = cluster_config(args)
    churn = lora_churn.LoraChurn() if args.lora_churn_s else None
    try:
        serve.run(build_app(config), name="soak", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{args.port}"
        wait_until_healthy(url, timeout=300)
        tally, marks = Tally(), {}

        async def run() -> tuple[float, int]:
            async with httpx.AsyncClient(timeout=args.request_timeout_s) as http:
                measured = await capacity(http, url, "demo", args.calibrate_s)
                if churn is not None:
                    await churn.start(http, url)
            rate = args.rate or args.load_fraction * measured
            print(f"soak: capacity {measured:.2f} req/s; offering {rate:.2f} req/s for {args.minutes} min", flush=True)
            return measured, rate, await load(args, url, "demo", rate, tally, marks, churn)

        started = time.monotonic()
        measured, rate, kills = asyncio.run(run())
        end = time.monotonic()
        growth, memory_traces = growth_by_process(marks.get("rss", {}), end, cluster_processes(url), args.trace_memory)
        held = leaked_blocks(url)
        restarted = counter_total(url, "splitserve_requests_restarted_total")  # placed again after a failure
        adapters = lora_churn.workers_hold_what_is_served(url, "soak") if churn else None
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"minutes": args.minutes, "wall_s": round(time.monotonic() - started, 1),
              "capacity_rps": round(measured, 3), "rate_rps": round(rate, 3), "kills": kills,
              "requests": sum(tally.outcomes.values()), "completed": tally.outcomes["completed"],
              "failed_with_error": tally.outcomes["failed_with_error"], "disconnected": tally.outcomes["disconnected"],
              "lost": tally.outcomes["lost"], "lost_reasons": dict(tally.lost_reasons),
              "lost_examples": tally.lost_examples,
              "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
              "refused_within_60s_after_a_kill": sum(any(0 <= t - k <= 60 for k in tally.kills_at)
                                                    for t in tally.refused_at),
              "controller_kills": len(tally.controller_kills_at),
              "failed_within_60s_after_a_controller_kill": sum(any(0 <= t - k <= 60 for k in tally.controller_kills_at)
                                                               for t in tally.failed_at),
              "requests_restarted": int(restarted), "leaked_blocks": sum(held.values()), "blocks_held": held,
              "rss_growth_mb": growth, **({"memory_trace": memory_traces} if args.trace_memory else {}),
              **({"lora_churn": {"every_s": args.lora_churn_s, "statuses": dict(churn.statuses), **adapters}}
                 if churn else {}),
              "backend": args.backend, "prompt_chunk_tokens": args.prompt_chunk_tokens,
              "layerwise_threshold": args.layerwise_threshold, "hardware": cpu_name()}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--rate", type=float, help="offered req/s (default: --load-fraction of measured capacity)")
    parser.add_argument("--load-fraction", type=float, default=0.7)
    parser.add_argument("--calibrate-s", type=float, default=20, help="how long to measure capacity")
    parser.add_argument("--kill-every-s", type=float, default=180, help="SIGKILL a random worker this often")
    parser.add_argument("--kill-controller-every-s", type=float,
                        help="SIGKILL the CLS this often (default: never)")
    parser.add_argument("--lora-churn-s", type=float,
                        help="unload a LoRA adapter and load it again (other weights) this often, while requests "
                             "name two adapters and the base model (default: no adapters)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1, help="share of clients that hang up")
    parser.add_argument("--request-timeout-s", type=float, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--backend", choices=("gloo", "ipc"), default="gloo",
                        help="KV transfer: a gloo pair, or written into the token worker's cache (shared memory)")
    parser.add_argument("--prompt-chunk-tokens", type=int,
                        help="prefill prompts in chunks of this many tokens (default: the engine's)")
    parser.add_argument("--layerwise-threshold", type=int, default=512,
                        help="prompt tokens from which the KV streams layer by layer (pieces of at least this many)")
    parser.add_argument("--trace-memory", metavar="DIR",
                        help="each Ray process writes its heap's state (and traced allocations) into DIR; "
                             "report what grew over each process's second half")
    parser.add_argument("--trace-every-s", type=float, default=300, help="interval of --trace-memory")
    parser.add_argument("--trace-frames", type=int, default=6,
                        help="frames traced per Python allocation (0: the heap's counts alone, at full speed)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
