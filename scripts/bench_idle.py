"""What an idle cluster costs its host's CPUs: the local demo cluster (`splitserve serve`'s
config) is brought up, left to settle, and every process's CPU time is read from /proc over a
window in which nothing is served. Once per value of the CLS's `idle_report_interval_s` (equal to
`report_interval_s`: it polls an idle cluster as fast as a busy one), in turn on one local Ray,
each value `--repeats` times, interleaved. Reported per run: the host's busy cores and each part's
share (workers, CLS, Serve, other actors, the rest: Ray's daemons and this script).

    python scripts/bench_idle.py --json idle.json
"""
from __future__ import annotations

import argparse
import statistics
import time

from splitserve.bench.report import write_results_json
from splitserve.machine import cpu_name
from splitserve.sim import host_cpu

PARTS = {"workers": host_cpu.WORKER_TITLES, "cls": ("ray::Controller",),
         "serve": ("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica"), "other actors": ("ray::",)}
REST = "rest"


def part(title: str) -> str:
    """The part of the cluster a process title belongs to (the first that names it)."""
    return next((name for name, prefixes in PARTS.items() if title.startswith(prefixes)), REST)


def cores_by_part(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  seconds: float) -> dict[str, float]:
    """Cores each part kept busy between two `host_cpu.processes_cpu_s` readings `seconds` apart
    (processes alive at both)."""
    cores = dict.fromkeys([*PARTS, REST], 0.0)
    for pid, (title, cpu_s) in after.items():
        if pid in before:
            cores[part(title)] += (cpu_s - before[pid][1]) / seconds
    return cores


def measure_idle(url: str, settle_s: float, window_s: float) -> dict:
    from splitserve.cluster.launcher import wait_until_healthy

    wait_until_healthy(url, timeout=300)
    time.sleep(settle_s)
    started, host, processes = time.perf_counter(), host_cpu.host_busy_s(), host_cpu.processes_cpu_s()
    time.sleep(window_s)
    seconds = time.perf_counter() - started
    host_end, processes_end = host_cpu.host_busy_s(), host_cpu.processes_cpu_s()
    return {"host_cores": (host_end - host) / seconds, **cores_by_part(processes, processes_end, seconds)}


def run(args) -> list[dict]:
    import ray
    from ray import serve

    from local_ray import start_serve  # this script's folder

    from splitserve.cluster.app import build_app

    start_serve(4, args.port)
    rows = []
    try:
        for repeat in range(args.repeats):
            for interval in args.idle_intervals:
                name = f"idle{repeat}-{str(interval).replace('.', '_')}"
                scheduler = {"report_interval_s": args.report_interval, "idle_report_interval_s": interval}
                serve.run(build_app({"scheduler": scheduler}), name=name, route_prefix=f"/{name}", blocking=False)
                cores = measure_idle(f"http://127.0.0.1:{args.port}/{name}", args.settle, args.window)
                serve.delete(name)
                rows.append({"idle_report_interval_s": interval, "repeat": repeat, **cores})
                print(f"idle_report_interval_s={interval:g}: {cores['host_cores']:.3f} cores busy", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per idle interval, the median of its runs for every measured part."""
    keys = ["host_cores", *PARTS, REST]
    intervals = sorted({r["idle_report_interval_s"] for r in rows})
    return [{"idle_report_interval_s": i, "runs": sum(r["idle_report_interval_s"] == i for r in rows),
             **{k: statistics.median(r[k] for r in rows if r["idle_report_interval_s"] == i) for k in keys}}
            for i in intervals]


def print_table(summary: list[dict], hardware: str, window_s: float) -> None:
    print(f"\nHardware: {hardware}. Cores kept busy while idle, over {window_s:g} s (median of the runs).\n")
    print(f"| idle_report_interval_s | runs | host | {' | '.join([*PARTS, REST])} |")
    print("|---:|---:|---:|" + "---:|" * (len(PARTS) + 1))
    for s in summary:
        cells = " | ".join(f"{s[k]:.3f}" for k in ["host_cores", *PARTS, REST])
        print(f"| {s['idle_report_interval_s']:g} | {s['runs']} | {cells} |")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-intervals", default="0.1,1", help="comma-separated idle_report_interval_s values")
    parser.add_argument("--report-interval", type=float, default=0.1, help="report_interval_s of every run")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after healthy before measuring")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8025)
    parser.add_argument("--json", help="write the runs and their summary here")
    args = parser.parse_args(argv)
    args.idle_intervals = [float(x) for x in args.idle_intervals.split(",")]
    if min(args.idle_intervals) < args.report_interval:
        parser.error("--idle-intervals: each must be at least --report-interval")
    rows = run(args)
    summary = summarize(rows)
    hardware = f"{cpu_name()}, the local demo cluster (1 prompt + 1 token worker)"
    print_table(summary, hardware, args.window)
    if args.json:
        write_results_json(args.json, hardware, args, rows, summary=summary)
    return summary


if __name__ == "__main__":
    main()
