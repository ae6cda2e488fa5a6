"""`splitserve sim`: replay a trace through a simulated cluster given by the same config file a
deployment uses, and write the same report a real `splitserve bench` run writes.

    splitserve sim --config deploy/splitwise-ha.yaml --trace conv --rate 40 --num-requests 5000 --out sim/
    splitserve sim --trace conv --rate 2 --length-scale 0.25 --profile cpu.csv --model demo --out sim/  # local-cpu
    splitserve sim ... --profile cpu.csv --overhead overhead.json  # + what `splitserve profile --url` measured
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from splitserve.bench.report import markdown_table, write_outputs
from splitserve.bench.workload import ARRIVALS, WorkloadSpec, make_workload
from splitserve.cluster.config import ClusterConfig, load_cluster_config
from splitserve.command import report_errors
from splitserve.sim.cluster import simulate
from splitserve.sim.from_config import SimTarget, scenario_from_config
from splitserve.sim.overhead import ServingOverhead


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a Serve config (deploy/*.yaml) or bare cluster config; default: local-cpu")
    p.add_argument("--model", default="llama2-70b", help="whose profiles stand in for the workers: llama2-70b, "
                                                         "bloom-176b, or demo / a checkpoint with --profile")
    p.add_argument("--tensor-parallel", type=int, default=8, help="profile rows to use (a worker is a TP-N machine)")
    p.add_argument("--profile", type=Path, default=None, help="a `splitserve profile` CSV for other hardware classes")
    p.add_argument("--bandwidth-gbps", type=float, default=400.0, help="KV transfer link between machines")
    p.add_argument("--overhead", type=Path, default=None,
                   help="the serving stack's overhead measured by `splitserve profile --url` (a JSON file); "
                        "a peer_slowdown in it puts every worker on one shared host")
    p.add_argument("--trace", default="conv")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=None, help="mean requests/s (default: the Azure trace's own)")
    p.add_argument("--arrivals", choices=ARRIVALS, default=None)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for requests.jsonl, summary.json, report.md, workers.json")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> dict:
    config = load_cluster_config(args.config)[0] if args.config else ClusterConfig()
    overhead = ServingOverhead.load(args.overhead) if args.overhead else ServingOverhead()
    target = SimTarget(args.model, args.tensor_parallel, args.profile, args.bandwidth_gbps, overhead=overhead)
    scenario = scenario_from_config(config, target)
    requests = make_workload(WorkloadSpec(trace=args.trace, num_requests=args.num_requests, rate=args.rate,
                                          arrivals=args.arrivals, length_scale=args.length_scale, seed=args.seed,
                                          max_prompt_tokens=scenario.max_model_len // 2,
                                          max_output_tokens=scenario.max_model_len // 2))
    started = time.perf_counter()
    with tqdm(total=len(requests), desc="simulated", unit="req", disable=args.no_progress, leave=False) as bar:
        result = simulate(scenario, requests, args.seed, progress=lambda done, _: bar.update(done - bar.n))
    wall = time.perf_counter() - started
    summary = {**result.summary(), "simulated_s": result.duration_s, "wall_s": wall,
               "simulated_requests_per_wall_s": len(requests) / wall}
    out = Path(args.out)
    write_outputs(out, result.records, summary, f"simulated: {args.trace}")
    (out / "workers.json").write_text(json.dumps([asdict(w) for w in result.workers], indent=2))
    print(markdown_table(summary))
    print(f"{len(requests)} requests, {result.duration_s:.0f} s simulated in {wall:.1f} s; results in {out}/")
    return summary


def run_command(args) -> int:
    return report_errors("sim", run, args, (ValueError, OSError, ValidationError))
