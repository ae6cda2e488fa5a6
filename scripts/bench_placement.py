"""Benchmark the cluster-level scheduler: decision time of `ClusterState.place` and of the report
handling (`ClusterState.report`, which runs the policy's rebalance) for every placement policy.

Clusters of 8, 64 and 512 workers, half prompt and half token, hardware classes h100 / a100 /
h100-cap in turn. A decision is one placement of a request whose lengths come from the ShareGPT
trace (seeded); reports are timed separately. Loads follow a fluid model, so pools
see what they would in service: a worker prefills PREFILL_TOKENS_PER_S x its prompt speed, decode
contexts decay with time constant `hold` (set so token queues average 60% of the overflow
threshold), requests arrive at --utilization (90%) of the prompt pool's capacity, and every worker reports every
REPORT_PERIOD_S (about 8 reports per placement at any cluster size). The policies run interleaved
(A B C A B C ...) on the same request and report stream. With --adapters N, each request runs
under one of N LoRA adapters (uniformly), and each worker reports LORA_SLOTS slots holding the last
distinct adapters placed on it, none idle once all are taken: LoRA-aware placement scores every
worker of a pool, not the blind choice and the prefix holders alone.

    python scripts/bench_placement.py                      # ~5 s on 2 shared cores
    python scripts/bench_placement.py --decisions 20000 --json placement.json
    python scripts/bench_placement.py --adapters 64
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import platform
import random
import statistics
import time
from collections import Counter
from pathlib import Path

from splitserve.data import TRACES_DIR
from splitserve.machine import cpu_name
from splitserve.placement import (
    PLACEMENT_POLICIES,
    ClusterState,
    PlacementRequest,
    PlacementThresholds,
    Role,
    WorkerLoad,
    WorkerState,
)
from splitserve.placement.hardware import HARDWARE_CLASSES
from splitserve.placement.state import AdapterOptions

TRACE = TRACES_DIR / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
HARDWARE_CYCLE = ("h100", "a100", "h100-cap")
KV_CAPACITY_TOKENS = 400_000
PREFILL_TOKENS_PER_S = 9000.0  # h100, llama2-70b: 1024 prompt tokens in ~114 ms (profiles/perf_model.csv)
DECODE_OVERFLOW_TOKENS = PlacementThresholds().mixed_decode_tokens
REPORT_PERIOD_S = 0.1  # each worker reports its load this often (Splitwise: not every iteration)
WARMUP_DECISIONS = 1000
LORA_SLOTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decisions", type=int, default=5000, help="timed decisions per policy and cluster size (5000)")
    p.add_argument("--workers", default="8,64,512", help="comma-separated cluster sizes (8,64,512)")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="offered prompt load / prompt pool capacity (0.9; above 1 the mixed pool fills)")
    p.add_argument("--adapters", type=int, default=0, help="LoRA adapters the requests run under (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the rows here")
    return p.parse_args(argv)


def load_requests() -> list[tuple[int, int]]:
    with open(TRACE) as trace:
        return [(int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])) for row in csv.DictReader(trace)]


class FluidLoad:
    """Loads of a cluster at steady state: what a worker reports given what was placed on it."""

    def __init__(self, requests: list[tuple[int, int]], num_workers: int, utilization: float, adapters: int):
        mean_prompt = statistics.fmean(p for p, _ in requests)
        mean_context = statistics.fmean(p + o for p, o in requests)
        mean_speed = statistics.fmean(HARDWARE_CLASSES[h].prompt_speed for h in HARDWARE_CYCLE)
        capacity = num_workers // 2 * mean_speed * PREFILL_TOKENS_PER_S
        self.interval_s = mean_prompt / (utilization * capacity)  # between requests
        self.hold_s = 0.6 * DECODE_OVERFLOW_TOKENS * (num_workers // 2) * self.interval_s / mean_context
        self.mean_context = mean_context
        self.lora_slots = LORA_SLOTS if adapters else 0

    def report(self, worker: WorkerState, now: float) -> WorkerLoad:
        elapsed = now - worker.reported_at
        prefilled = worker.hardware.prompt_speed * PREFILL_TOKENS_PER_S * elapsed
        pending = max(0, round(worker.load.pending_prompt_tokens + worker.placed_prompt_tokens - prefilled))
        decode = round((worker.load.decode_tokens + worker.placed_decode_tokens) * math.exp(-elapsed / self.hold_s))
        resident = (worker.load.lora_resident + worker.placed_adapters)[-self.lora_slots:] if self.lora_slots else ()
        return WorkerLoad(pending_prompt_tokens=pending, decode_tokens=decode,
                          num_decoding=round(decode / self.mean_context), num_waiting=round(pending / 800),
                          free_kv_tokens=max(0, KV_CAPACITY_TOKENS - decode - pending),
                          total_kv_tokens=KV_CAPACITY_TOKENS, lora_slots=self.lora_slots, lora_resident=resident,
                          lora_idle_slots=self.lora_slots - len(resident))


def build_cluster(policy: str, num_workers: int, adapters: int) -> ClusterState:
    """As the controller builds it: adapter-aware where the workers have adapter slots."""
    state = ClusterState(policy, adapters=AdapterOptions(aware=adapters > 0))
    for index in range(num_workers):
        home = Role.PROMPT if index < num_workers // 2 else Role.TOKEN
        hardware = HARDWARE_CLASSES[HARDWARE_CYCLE[index % len(HARDWARE_CYCLE)]]
        state.add_worker(f"w{index:04d}", home, hardware, WorkerLoad(total_kv_tokens=KV_CAPACITY_TOKENS,
                                                                     free_kv_tokens=KV_CAPACITY_TOKENS))
    return state


class PolicyRun:
    """One policy's cluster and the time of each of its report() and place() calls."""

    def __init__(self, policy: str, num_workers: int, adapters: int):
        self.state = build_cluster(policy, num_workers, adapters)
        self.place_ns: list[int] = []
        self.report_ns: list[int] = []
        self.outcomes: Counter = Counter()

    def report(self, worker_id: str, fluid: FluidLoad, now: float, timed: bool) -> None:
        load = fluid.report(self.state.workers[worker_id], now)
        start = time.perf_counter_ns()
        self.state.report(worker_id, load, now)
        self.report_ns.extend([time.perf_counter_ns() - start] if timed else [])

    def place(self, request: PlacementRequest, now: float, timed: bool) -> None:
        start = time.perf_counter_ns()
        placement, moves = self.state.place(request, now)
        self.place_ns.extend([time.perf_counter_ns() - start] if timed else [])
        self.outcomes.update(rejected=placement is None, local=placement is not None and placement.local,
                             moves=len(moves))


def time_decisions(num_workers: int, args: argparse.Namespace, requests: list[tuple[int, int]]) -> list[dict]:
    """Every policy on the same stream of reports and requests, interleaved call by call."""
    rng = random.Random(args.seed)
    fluid = FluidLoad(requests, num_workers, args.utilization, args.adapters)
    runs = {name: PolicyRun(name, num_workers, args.adapters) for name in PLACEMENT_POLICIES}
    report_order = sorted(runs["jsq"].state.workers)
    rng.shuffle(report_order)  # staggered: the workers report one after another, each every REPORT_PERIOD_S
    reports_done = 0
    for step in range(WARMUP_DECISIONS + args.decisions):
        now, timed = step * fluid.interval_s, step >= WARMUP_DECISIONS
        for _ in range(reports_done, int(now / REPORT_PERIOD_S * num_workers)):
            for run in runs.values():
                run.report(report_order[reports_done % num_workers], fluid, now, timed)
            reports_done += 1
        prompt_len, output_len = rng.choice(requests)
        lora = f"lora-{rng.randrange(args.adapters)}" if args.adapters else None
        for run in runs.values():
            run.place(PlacementRequest(f"r{step}", prompt_len, output_len, lora=lora), now, timed)
    return [summarize(name, num_workers, run, args.adapters) for name, run in runs.items()]


def percentile_us(values_ns: list[int], fraction: float) -> float:
    ordered = sorted(values_ns)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000, 2)


def summarize(policy: str, num_workers: int, run: PolicyRun, adapters: int) -> dict:
    return {"policy": policy, "workers": num_workers, "adapters": adapters, "decisions": len(run.place_ns),
            "p50_us": percentile_us(run.place_ns, 0.5), "p99_us": percentile_us(run.place_ns, 0.99),
            "report_p50_us": percentile_us(run.report_ns, 0.5), "report_p99_us": percentile_us(run.report_ns, 0.99),
            "reports": len(run.report_ns), "rejected": run.outcomes["rejected"], "local": run.outcomes["local"],
            "pool_moves_at_placement": run.outcomes["moves"]}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| policy | workers | adapters | place p50 (µs) | place p99 (µs) | report p50 (µs) | report p99 (µs) "
             "| decisions | local | rejected |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['policy']} | {r['workers']} | {r['adapters']} | {r['p50_us']} | {r['p99_us']} "
              f"| {r['report_p50_us']} "
              f"| {r['report_p99_us']} | {r['decisions']} | {r['local']} | {r['rejected']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.decisions < 1 or args.utilization <= 0 or args.adapters < 0:
        raise ValueError(f"--decisions must be >= 1, --utilization > 0 and --adapters >= 0, got {args.decisions}, "
                         f"{args.utilization}, {args.adapters}")
    requests = load_requests()
    gc.freeze()  # the collector stays on, but does not rescan the imported libraries (torch) each time
    rows = [row for size in args.workers.split(",") for row in time_decisions(int(size), args, requests)]
    print(f"CPU: {cpu_name()}, Python {platform.python_version()}; {args.decisions} decisions per row, "
          f"utilization {args.utilization}, seed {args.seed}")
    print(markdown_table(rows))
    if args.json:
        meta = {"cpu": cpu_name(), "python": platform.python_version(), "utilization": args.utilization}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
