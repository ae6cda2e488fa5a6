"""LoRA-aware against LoRA-blind placement, simulated: many adapters served through few slots per
worker (engine.max_cpu_loras past engine.max_loras), on Splitwise's clusters.

The same requests (the conversation trace's lengths, Poisson arrivals at each --rates, each under
one of N adapters, for each N of --adapters, drawn by Zipf rank with exponent --zipf) on the same cluster (a
Splitwise --design of --prompt / --token DGX machines, Llama2-70B at TP 8, --slots adapter slots a
machine, a swap into a slot taking --swap-ms), placed by the real CLS:

- aware: `scheduler.lora_aware: true`: a worker whose slots do not hold the request's adapter counts
  as more loaded (a swap's or a wait's share of the overflow threshold), so each adapter's requests
  gather where a slot holds it;
- blind: placement by queue lengths alone;
- and for reference, the same requests under no adapter.

Per rate, adapter count and placement: P50 / P99 TTFT, TBT and end-to-end latency, the swaps the
workers made, and the requests refused. The simulator runs the engine's own schedulers and slot residency, with the
adapters' compute not modelled (it is the same under either placement).

    python scripts/bench_lora_placement.py --json lora-placement.json
"""
from __future__ import annotations

import argparse
import dataclasses
import platform

from splitserve.bench.report import write_results_json
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.machine import cpu_name
from splitserve.placement.state import AdapterOptions
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import DESIGNS, design

PLACEMENTS = ("aware", "blind")
METRICS = ("ttft_s", "tbt_s", "e2e_s")
COLUMNS = ["rate", "adapters", "placement", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "e2e_p50_s",
           "e2e_p99_s", "lora_swaps", "num_failed"]


def run(args, rate: float, adapters: int, placement: str) -> dict:
    scenario = dataclasses.replace(design(args.design).scenario(args.prompt, args.token), max_loras=args.slots,
                                   lora_swap_s=args.swap_ms / 1000,
                                   adapters=AdapterOptions(aware=placement == "aware"))
    requests = make_workload(WorkloadSpec(trace="conv", num_requests=args.num_requests, rate=rate, seed=args.seed,
                                          max_prompt_tokens=scenario.max_model_len // 2,
                                          max_output_tokens=scenario.max_model_len // 2,
                                          adapters=tuple(f"lora-{k}" for k in range(adapters)),
                                          adapter_zipf=args.zipf))
    result = simulate(scenario, requests, args.seed)
    summary = result.summary()
    row = {"rate": rate, "adapters": adapters, "placement": placement, "num_failed": summary["num_failed"],
           "lora_swaps": sum(w.lora_swaps for w in result.workers)}
    for metric in METRICS:
        row.update({f"{metric[:-2]}_p50_s": summary[metric]["p50"], f"{metric[:-2]}_p99_s": summary[metric]["p99"]})
    return row


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3f}" if c.endswith("_s") else str(row[c]) for c in COLUMNS) + " |")
    blind = {(row["rate"], row["adapters"]): row for row in rows if row["placement"] == "blind"}
    for row in rows:
        if row["placement"] == "aware":
            other = blind[row["rate"], row["adapters"]]
            ratios = ", ".join(f"{name} p99 {other[f'{name}_p99_s'] / row[f'{name}_p99_s']:.2f}x"
                               for name in ("ttft", "tbt", "e2e"))
            swaps = other["lora_swaps"] / max(1, row["lora_swaps"])
            print(f"rate {row['rate']}, {row['adapters']} adapters: blind / aware: {ratios}; swaps {swaps:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=list(DESIGNS), default="splitwise-hh")
    parser.add_argument("--prompt", type=int, default=5, help="prompt machines (a baseline design: mixed ones)")
    parser.add_argument("--token", type=int, default=3, help="token machines (0 for a baseline design)")
    parser.add_argument("--rates", type=float, nargs="+", default=[6.0, 10.0, 14.0])
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--adapters", type=int, nargs="+", default=[16, 24, 64])
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=8, help="adapter slots a machine (engine.max_loras)")
    parser.add_argument("--swap-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for rate in args.rates:
        rows.append(run(args, rate, 0, "none"))
        rows += [run(args, rate, adapters, placement) for adapters in args.adapters for placement in PLACEMENTS]
    print_table(rows)
    if args.json:
        write_results_json(args.json, cpu_name(), args, rows, python=platform.python_version())


if __name__ == "__main__":
    main()
