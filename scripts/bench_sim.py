"""How fast the simulator runs: the Azure conversation trace (its own arrivals) on a 40-machine
Splitwise-HH cluster (25 prompt + 15 token DGX-H100s, Llama2-70B at tensor parallel 8, Splitwise's
iso-power conversation design), timed on this machine.

    python scripts/bench_sim.py                      # the whole hour: 19,366 requests
    python scripts/bench_sim.py --num-requests 2000 --json out.json
    python scripts/bench_sim.py --profile            # cProfile: where the time goes
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import time

from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.placement import Role
from splitserve.sim.cluster import simulate
from splitserve.sim.perf_model import MODEL_SHAPES, load_perf_models
from splitserve.sim.scenario import PoolSpec, Scenario
from splitserve.sim.transfer import TransferModel

MODEL, HARDWARE, TENSOR_PARALLEL = "llama2-70b", "h100-80gb", 8
# DGX-H100: 8 x 80 GB, ~10% kept back, 140 GB of fp16 weights; KV sized as the Splitwise simulator does
KV_BUDGET_TOKENS = int((8 * 80e9 * 0.9 - 140e9) / MODEL_SHAPES[MODEL].kv_bytes_per_token)


def splitwise_hh(prompt_machines: int = 25, token_machines: int = 15) -> Scenario:
    shape = MODEL_SHAPES[MODEL]
    return Scenario(
        pools=(PoolSpec(Role.PROMPT, prompt_machines, HARDWARE), PoolSpec(Role.TOKEN, token_machines, HARDWARE)),
        perf_models={HARDWARE: load_perf_models()[MODEL, HARDWARE, TENSOR_PARALLEL]},
        kv_budget_tokens=KV_BUDGET_TOKENS,
        transfer=TransferModel(kv_bytes_per_token=shape.kv_bytes_per_token, num_layers=shape.num_layers))


def run(num_requests: int, profile: bool) -> dict:
    requests = make_workload(WorkloadSpec(trace="conv", num_requests=num_requests))
    scenario = splitwise_hh()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    result = simulate(scenario, requests)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    summary = result.summary()
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "num_requests": num_requests, "wall_time_s": wall,
            "simulated_requests_per_s": num_requests / wall, "simulated_s": result.duration_s,
            "num_events": result.num_events, "iterations": sum(w.iterations for w in result.workers),
            "pool_moves": sum(w.pool_moves for w in result.workers),
            **{key: summary[key] for key in ("num_completed", "num_rejected", "throughput_rps", "ttft_s",
                                             "tbt_s", "e2e_s")}}


def _print(report: dict) -> None:
    print(f"conv trace, {report['num_requests']} requests, Splitwise-HH 25P + 15T ({MODEL}, {HARDWARE} TP"
          f"{TENSOR_PARALLEL}): {report['simulated_s']:.0f} s simulated in {report['wall_time_s']:.1f} s wall "
          f"({report['simulated_requests_per_s']:.0f} requests/s, {report['iterations']} iterations, "
          f"{report['num_events']} events, {report['pool_moves']} pool moves)")
    print(f"completed {report['num_completed']}, rejected {report['num_rejected']}; on {report['machine']}")
    for key in ("ttft_s", "tbt_s", "e2e_s"):
        row = report[key]
        print(f"  {key:7s} p50 {row['p50']:.4f}  p90 {row['p90']:.4f}  p99 {row['p99']:.4f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=19366)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--profile", action="store_true", help="run under cProfile and print the top functions")
    args = parser.parse_args(argv)
    report = run(args.num_requests, args.profile)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
