"""The same KV memory with the serving dtype's cache and with an FP8 cache (`kv_cache_dtype: fp8`):
how many sequences run at once, how often one is preempted, and what that does to throughput.

One engine per cache (mixed policy, `max_num_seqs` = the number of requests, so only the KV cache
limits the batch), the same KV bytes for both: enough for --fit sequences' whole prompt and output
in the serving dtype. Every request is sent at once with a forced output length; each step's
running sequences are counted. The two engines run side by side in one process, interleaved
(auto, fp8, auto, ...) after a warm-up, medians with [min-max] over --repeats; the first outputs
of the two are compared token by token (the FP8 cache rounds keys and values, so greedy tokens may
part ways).

    python scripts/bench_kv_cache_dtype.py --json kv-dtype.json            # the demo model on CPU, bf16
    python scripts/bench_kv_cache_dtype.py --model /path/to/ckpt --device cuda --fit 64 --requests 256
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_builder import load_metadata, resolve_dtype
from splitserve.engine.sampling_params import SamplingParams
from splitserve.machine import cpu_name

CACHES = ("auto", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help='"demo" (built-in, random weights) or a checkpoint directory')
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="the serving dtype (the auto cache's)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--fit", type=int, default=12, help="sequences whose whole length the KV bytes hold in the "
                                                       "serving dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.requests, args.prompt_len, args.output_len, args.fit, args.repeats, args.threads) < 1:
        p.error("--requests, --prompt-len, --output-len, --fit, --repeats and --threads must be >= 1")
    return args


def kv_bytes(args) -> int:
    """The serving dtype's bytes for --fit whole sequences, in whole blocks."""
    config, _, _ = load_metadata(args.model, EngineConfig())
    blocks = -(-(args.prompt_len + args.output_len) // args.block_size)
    return args.fit * blocks * KVCache.bytes_per_block(config, args.block_size, resolve_dtype(args.dtype, config))


def run(args, cache: str, budget: int, prompts: list[list[int]]) -> dict:
    engine = LLMEngine(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=cache, policy="mixed",
                       kv_cache_memory_bytes=budget, block_size=args.block_size, max_num_seqs=len(prompts),
                       max_model_len=args.prompt_len + args.output_len + args.block_size, enable_prefix_caching=False)
    return drive(engine, prompts, args.output_len)


class StepLog:
    """An engine's steps from now on: the sequences running after each, when each request's first
    output came, and the finished requests' tokens."""

    def __init__(self):
        gc.collect()
        self.start, self.running, self.first, self.done = time.perf_counter(), [], {}, {}

    def step(self, engine: LLMEngine) -> None:
        outputs = engine.step()
        now = time.perf_counter() - self.start
        self.running.append(len(engine.policy.running))
        for out in outputs:
            self.first.setdefault(out.request_id, now)
        self.done.update((out.request_id, out.outputs[0].token_ids) for out in outputs if out.finished)

    def result(self, engine: LLMEngine, num_requests: int, output_len: int, first: str) -> dict:
        """Throughput, the first outputs' p50 and p90 (as `first`_p50_s, `first`_p90_s), the
        counts, and the tokens of requests "0" .. `num_requests` - 1."""
        seconds = time.perf_counter() - self.start
        waits = statistics.quantiles(self.first.values(), n=10, method="inclusive") if len(self.first) > 1 \
            else [seconds] * 9
        return {"seconds": seconds, "output_tokens_per_s": num_requests * output_len / seconds,
                f"{first}_p50_s": waits[4], f"{first}_p90_s": waits[8], "kv_blocks": engine.kv_cache.num_blocks,
                "peak_running": max(self.running), "mean_running": statistics.mean(self.running),
                "steps": len(self.running), "preemptions": engine.policy.num_preemptions,
                "tokens": [self.done[str(i)] for i in range(num_requests)]}


def drive(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Send every prompt at once (greedy, `output_len` tokens each) and step until all are done,
    counting each step's running sequences and timing each request's first token."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    log = StepLog()
    while engine.has_unfinished_requests():
        log.step(engine)
    return log.result(engine, len(prompts), output_len, "ttft")


def interleaved(variants: tuple[str, ...], repeats: int, prompts: list[list[int]],
                run_one: Callable[[str, list[list[int]]], dict]) -> dict[str, list[dict]]:
    """Each variant's `repeats` runs of `prompts`, taken in turn (a, b, a, b, ...) after a warm-up
    of each on two prompts, not counted: torch's first steps are slower."""
    for variant in variants:
        run_one(variant, prompts[:2])
    runs = {variant: [] for variant in variants}
    for _ in range(repeats):
        for variant in variants:
            runs[variant].append(run_one(variant, prompts))
    return runs


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


FIRST_OUTPUTS = {"ttft": "TTFT", "second_token": "2nd token"}  # StepLog.result's `first`: its column


def row_of(runs: list[dict], first: str = "ttft") -> dict:
    """One engine's repeats of `drive` (or a `StepLog.result`): the first run's counts, the others' spread."""
    keys = ("mean_running", "preemptions", "steps", f"{first}_p50_s", f"{first}_p90_s", "output_tokens_per_s")
    return {"kv_blocks": runs[0]["kv_blocks"], "peak_running": runs[0]["peak_running"],
            **{key: summary([x[key] for x in runs]) for key in keys}}


def print_rows(rows: dict[str, dict], label: str, first: str = "ttft") -> None:
    print(f"| {label} | blocks | peak running | mean running | preemptions | steps | "
          f"{FIRST_OUTPUTS[first]} p50 / p90 s | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        tps = row["output_tokens_per_s"]
        print(f"| {name} | {row['kv_blocks']} | {row['peak_running']} | {row['mean_running']['median']:.1f} | "
              f"{row['preemptions']['median']:.0f} | {row['steps']['median']:.0f} | "
              f"{row[f'{first}_p50_s']['median']:.2f} / {row[f'{first}_p90_s']['median']:.2f} | "
              f"{tps['median']:.0f} [{tps['min']:.0f}-{tps['max']:.0f}] |")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    budget = kv_bytes(args)
    runs = interleaved(CACHES, args.repeats, prompts, lambda cache, some: run(args, cache, budget, some))
    first = {cache: runs[cache][0]["tokens"] for cache in CACHES}
    same = sum(a == b for x, y in zip(first["auto"], first["fp8"]) for a, b in zip(x, y))
    rows = {cache: row_of(r) for cache, r in runs.items()}
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "kv_cache_bytes": budget, "hardware": {"cpu": cpu_name(), "torch": torch.__version__,
                                                     "threads": torch.get_num_threads()},
              "caches": rows,
              "throughput_ratio_fp8_vs_auto": rows["fp8"]["output_tokens_per_s"]["median"]
              / rows["auto"]["output_tokens_per_s"]["median"],
              "greedy_tokens_equal_fraction": same / (args.requests * args.output_len)}
    print(f"KV cache: {budget / 2**20:.1f} MiB ({args.fit} sequences of {args.prompt_len + args.output_len} tokens "
          f"in {args.dtype}); {args.requests} requests at once")
    print_rows(rows, "cache")
    print(f"fp8 / auto throughput: {result['throughput_ratio_fp8_vs_auto']:.2f}x; greedy tokens equal: "
          f"{result['greedy_tokens_equal_fraction']:.1%}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
