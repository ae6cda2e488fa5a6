"""Does the simulator predict a real cluster? The same short trace, replayed against a local CPU
cluster and simulated from that cluster's config, its engine's profile (`splitserve profile`) and
the serving overhead measured on it (`splitserve profile --url --shared-host`, with how much a busy
worker slows the other on the shared cores); one round per seed, pooled. Each round is simulated
with that contention and without it (workers on cores of their own), and replayed a second time with
fresh prompts: how far the cluster lands from itself is the floor under the simulator's error.
`--alone N` also sends the trace's first N requests one at a time, real and simulated: with no load
to model, what is left is the overhead calibration's own error.

The cluster is deploy/local-cpu.yaml's (or --config's) on a fresh local Ray, or --url's. This
process lowers its own priority to the Ray workers' niceness (15), so the load generator competes
for the cores as a peer of the workers, as a client on another machine would not compete at all.

    python scripts/validate_sim.py --json validate.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from splitserve.bench.workload import WorkloadSpec
from splitserve.config import ClusterConfig, load_cluster_config
from splitserve.machine import cpu_name
from splitserve.sim.profile import ProfileSpec, run_profile, write_csv
from splitserve.sim.validate import validate

RAY_WORKER_NICENESS = 15  # Ray's default for worker processes (RAY_worker_niceness)


def engine_profile(args, config: ClusterConfig, folder: Path, batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Path:
    """--engine-profile, or a `splitserve profile` of the config's model on this CPU, measured now."""
    if args.engine_profile:
        return Path(args.engine_profile)
    start = time.perf_counter()
    spec = ProfileSpec(config.model, "cpu", prompt_sizes=(32, 64, 128, 256, 512, 1024), batch_sizes=batch_sizes,
                       repeats=2)
    path = write_csv(run_profile(spec).rows, folder / "engine.csv")
    print(f"engine profile: {time.perf_counter() - start:.0f} s", flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the cluster's config (deploy/*.yaml); default: local-cpu")
    parser.add_argument("--url", help="a running cluster deployed with --config (default: start one)")
    parser.add_argument("--engine-profile", help="a `splitserve profile` CSV (default: measure one first)")
    parser.add_argument("--trace", default="conv")
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--alone", type=int, default=0, metavar="N",
                        help="also send the trace's first N requests one at a time, real and simulated (no load: "
                             "the overhead calibration's own error)")
    parser.add_argument("--json", help="write the rounds and the pooled comparison here")
    args = parser.parse_args()
    config = load_cluster_config(args.config)[0] if args.config else ClusterConfig()
    os.nice(RAY_WORKER_NICENESS - os.nice(0))
    with tempfile.TemporaryDirectory() as folder:
        profile = engine_profile(args, config, Path(folder))
        url, started = args.url, args.url is None
        if started:
            from splitserve.cluster.launcher import deploy

            url = deploy(config, "127.0.0.1", 8000, None)
        try:
            workload = WorkloadSpec(args.trace, args.num_requests, rate=args.rate, arrivals="poisson",
                                    length_scale=args.length_scale)
            result = validate(url, config, profile, workload, args.seeds, alone=args.alone)
        finally:
            if started:
                from splitserve.cluster.launcher import teardown

                teardown(joined=False)
    result = {"hardware": cpu_name(), "workload": vars(args), **result}
    print(f"\npooled over seeds {args.seeds} ({result['num_requests']} requests, {result['num_failed']} failed), "
          f"{result['hardware']}:")
    print("| metric | run | real p50 | its p50 | ratio | real p99 | its p99 | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for metric in ("ttft_s", "tbt_s"):
        for name, label in (("sim", "simulated, cores shared"), ("sim_independent", "simulated, cores of their own"),
                            ("real_again", "the same trace again, fresh prompts")):
            real, its, ratio = result["real"][metric], result[name][metric], result[f"{name}_over_real"][metric]
            cells = [_ms(v[q]) if v is not ratio else f"{v[q]:.2f}"
                     for q in ("p50", "p99") for v in (real, its, ratio)]
            print(f"| {metric[:-2].upper()} | {label} | " + " | ".join(cells) + " |")
    print("\ntoken gaps by what else ran (splitserve.sim.token_gaps), simulated with cores shared:")
    print("| gap | real n | real p50 | sim p50 | real p99 | sim p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, real in result["tbt_by_class"]["real"].items():
        sim = result["tbt_by_class"]["sim"][name]
        cells = [_ms(side[q]) for q in ("p50", "p99") for side in (real, sim)]
        print(f"| {name} | {real['n']} | " + " | ".join(cells) + " |")
    if args.alone:
        alone = result["alone"]
        print(f"\nthe first {args.alone} requests one at a time: TTFT p50 real {alone['real'] * 1000:.1f} ms, "
              f"simulated {alone['sim'] * 1000:.1f} ms ({alone['sim_over_real']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


if __name__ == "__main__":
    main()
