"""What the garbage collector's full passes cost each of the cluster's actor processes, with their
start-up heap in the passes and frozen out of them (`cluster/frozen_heap.py`; Ray Serve freezes its
replicas' the same way).

For each actor, a fresh Python process imports what that actor's process does (Ray and the
actor's module) and collects; then it times a full pass (`gc.collect()`, the GIL held throughout,
so the actor's loop and every call waiting on it stop) and reading back one large stored response
(`json.loads` of a response with --logprob-tokens tokens' logprobs at top 5, about 6 MB at 20,000:
what the response store does for each file when it restarts, and the passes its objects start),
first as it is, then after `gc.freeze()`. Medians of --repeats.

    python scripts/bench_actor_heaps.py                    # ~30 s on 2 shared cores
    python scripts/bench_actor_heaps.py --json actor_heaps.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from splitserve.machine import cpu_name

# actor (as `ray list actors` names its class) -> the module its process imports
ACTORS = {"Controller (the CLS)": "splitserve.cluster.controller", "BatchManager": "splitserve.cluster.batch_manager",
          "PersistedResponseStore": "splitserve.cluster.persisted_responses",
          "Worker (not frozen)": "splitserve.cluster.worker"}

PROBE = """
import gc, json, statistics, sys, time
import ray, {module}
from bench_response_store import logprobs
text = json.dumps({{"output": [{{"content": [{{"logprobs": logprobs({tokens})}}]}}]}})

def median_s(work):
    times = []
    for _ in range({repeats}):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

gc.collect()
row = {{"objects": len(gc.get_objects()), "json_mb": len(text) / 1e6}}
for state in ("unfrozen", "frozen"):
    if state == "frozen":
        gc.freeze()
    row[f"full_pass_s_{{state}}"] = median_s(gc.collect)
    row[f"json_loads_s_{{state}}"] = median_s(lambda: json.loads(text))
print(json.dumps(row))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timings of each, median taken (3)")
    p.add_argument("--logprob-tokens", type=int, default=20_000, help="tokens' logprobs in the response read (20000)")
    p.add_argument("--json", type=Path, help="write the rows here")
    return p.parse_args(argv)


def measure(module: str, args: argparse.Namespace) -> dict:
    code = PROBE.format(module=module, tokens=args.logprob_tokens, repeats=args.repeats)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent, timeout=600)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = [{"actor": actor, "module": module, **measure(module, args)} for actor, module in ACTORS.items()]
    print(f"CPU: {cpu_name()}; Python {platform.python_version()}; a response of {rows[0]['json_mb']:.1f} MB of JSON")
    print("| actor | start-up objects | full pass s | frozen | json.loads s | frozen |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['actor']} | {r['objects']:,} | {r['full_pass_s_unfrozen']:.3f} | {r['full_pass_s_frozen']:.4f} | "
              f"{r['json_loads_s_unfrozen']:.3f} | {r['json_loads_s_frozen']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "python": platform.python_version(), "rows": rows},
                                        indent=1))
    return rows


if __name__ == "__main__":
    main()
