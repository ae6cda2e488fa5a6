"""How fast the simulator runs, and in how much memory (issue 20): Splitwise-HH on 40 DGX-H100s,
Llama2-70B, Poisson arrivals at 70 req/s for 10 minutes (42,000 requests), splitwise-sim's decode
rule, on the code trace (35 prompt / 5 token machines) and the conversation trace (25 / 15).

Each run is `splitserve sim` in a fresh process; its wall time is the process's, start to exit
(imports and workload included), its peak RSS the process's maximum resident set (getrusage).
Repeats interleave the traces (code, conv, code, conv, ...).

    python scripts/bench_sim.py                       # both runs, a table
    python scripts/bench_sim.py --repeats 3 --json sim-speed.json
    python scripts/bench_sim.py --traces conv --profile   # cProfile of the run: where the time goes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN, RATE, DECODE_RULE = "splitwise-hh", 70.0, "splitwise-sim"
SPLITS = {"code": (35, 5), "conv": (25, 15)}  # prompt, token machines
TRACE_NAMES = {"code": "code", "conv": "conversation"}


def sim_command(trace: str, duration_s: float, summary: Path) -> list[str]:
    prompt, token = SPLITS[trace]
    return ["-m", "splitserve.cli", "sim", "--design", DESIGN, "--prompt-machines", str(prompt),
            "--token-machines", str(token), "--trace", trace, "--rate", str(RATE), "--duration", str(duration_s),
            "--decode-rule", DECODE_RULE, "--json", str(summary), "--no-progress"]


def run_once(trace: str, duration_s: float, profile: Path | None = None) -> dict:
    """One simulation in a fresh process: its row (wall time, peak RSS, the summary's latencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "summary.json"
        profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        start = time.perf_counter()
        # in ROOT, whose package `-m` then imports ahead of any other splitserve on the path
        child = subprocess.Popen([sys.executable, *profiler, *sim_command(trace, duration_s, summary_path)],
                                 cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not all children's
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if child.returncode != 0:
            raise RuntimeError(f"splitserve sim ({trace}) exited with {child.returncode}")
        summary = json.loads(summary_path.read_text())
    prompt, token = SPLITS[trace]
    return {"trace": TRACE_NAMES[trace], "design": DESIGN, "prompt_machines": prompt, "token_machines": token,
            "rate": RATE, "duration_s": duration_s, "decode_rule": DECODE_RULE,
            "num_requests": summary["num_requests"], "num_completed": summary["num_completed"],
            "wall_time_s": wall, "simulate_s": summary["wall_time_s"],
            "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux reports kilobytes
            **{key: summary[key] for key in ("simulated_s", "ttft_s", "tbt_s", "e2e_s")}, "machine": machine()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def print_table(rows: list[dict]) -> None:
    print(f"{DESIGN}, {RATE:g} req/s, {DECODE_RULE} decode rule; on {rows[0]['machine']}")
    print("| trace | split | requests | runs | wall time (s), median [min, max] | peak RSS (MB), median [min, max] "
          "| TTFT p50 / p99 (s) | TBT p50 / p99 (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for trace in dict.fromkeys(row["trace"] for row in rows):
        runs = [row for row in rows if row["trace"] == trace]
        first = runs[0]
        print(f"| {trace} | {first['prompt_machines']}P + {first['token_machines']}T | {first['num_requests']} "
              f"| {len(runs)} | {_spread([r['wall_time_s'] for r in runs], '.1f')} "
              f"| {_spread([r['peak_rss_mb'] for r in runs], '.0f')} "
              f"| {first['ttft_s']['p50']:.4f} / {first['ttft_s']['p99']:.4f} "
              f"| {first['tbt_s']['p50']:.4f} / {first['tbt_s']['p99']:.4f} |")


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (600: 42,000 requests)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each trace, interleaved")
    parser.add_argument("--json", type=Path, help="write the rows (one per run) here")
    parser.add_argument("--profile", action="store_true",
                        help="run each trace once under cProfile and print its top functions (wall times then "
                             "include the profiler's overhead)")
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.repeats):
        for trace in args.traces:
            with tempfile.TemporaryDirectory() as tmp:
                profile = Path(tmp) / "sim.prof" if args.profile else None
                rows.append(run_once(trace, args.duration, profile))
                if profile:
                    print(f"--- {TRACE_NAMES[trace]} trace: top functions by own time")
                    pstats.Stats(str(profile)).sort_stats("tottime").print_stats(25)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
