"""What a batch's results cost the batch service's event loop: each finished line is appended to
the batch's result log and counted in its saved progress (request counts and usage). Two ways,
side by side, interleaved, on one store directory:

- "per result": the log synced and the batch object saved (a synced rename) at every result, as
  the service did before (both intervals set to 0);
- "grouped": the log synced at most every `results.SYNC_EVERY_S`, the progress saved at most
  every `service.SAVE_EVERY_S` and when the run returns (the service's defaults).

A stand-in executor finishes every line at once (no model), yielding to the loop between
results, so the figure is the service's own ceiling on results a second; ms per result is the
loop's time each takes. Medians over --repeats.

    python scripts/bench_batch_results.py                      # a temporary store on this disk
    python scripts/bench_batch_results.py --dir /mnt/volume --lines 5000 --json results.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_moe import emit, print_markdown, ratio  # this script's folder

from splitserve.api.usage import Usage
from splitserve.batch import results, service
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore

LINE_USAGE = Usage(prompt_tokens=90, completion_tokens=4)
MODES = {"per result": (0.0, 0.0), "grouped": (results.SYNC_EVERY_S, service.SAVE_EVERY_S)}


class InstantExecutor:
    """Answers every line at once, on the loop, yielding to it between results."""

    async def run(self, lines, output, errors, options, stop, on_result) -> None:
        for line in lines:
            if stop():
                return
            output.append({"custom_id": line.custom_id, "error": None,
                           "response": {"status_code": 200, "body": {"usage": LINE_USAGE.body()}}})
            on_result(True)
            await asyncio.sleep(0)


def batch_input(lines: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "demo", "prompt": f"Question {i}?", "max_tokens": 4}}) + "\n"
                   for i in range(lines)).encode()


async def one_batch(root: Path, content: bytes) -> float:
    """Seconds from the batch's creation to its completion."""
    batches = BatchService(BatchStore(root), InstantExecutor())
    await batches.start()
    try:
        upload = await batches.create_file(content, "in.jsonl", "batch")
        start = time.perf_counter()
        batch_id = (await batches.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        while batches.get_batch(batch_id)["status"] != "completed":
            await asyncio.sleep(0.001)
        return time.perf_counter() - start
    finally:
        await batches.stop()


def measure(root: Path, lines: int, repeats: int) -> list[dict]:
    content, seconds = batch_input(lines), {mode: [] for mode in MODES}
    try:
        for _ in range(repeats):
            for mode, (sync_s, save_s) in MODES.items():
                results.SYNC_EVERY_S, service.SAVE_EVERY_S = sync_s, save_s
                seconds[mode].append(asyncio.run(one_batch(root, content)))
    finally:
        results.SYNC_EVERY_S, service.SAVE_EVERY_S = MODES["grouped"]
    return [{"mode": mode, "results_per_s": lines / statistics.median(s), "ms_per_result": statistics.median(s)
             / lines * 1e3, "seconds": s} for mode, s in seconds.items()]


def show(result: dict) -> None:
    print(f"{result['lines']} results a batch, store in {result['dir']}, median of {result['repeats']}")
    print_markdown(["mode", "results / s:", "ms per result:"],
                   [[r["mode"], f"{r['results_per_s']:.0f}", f"{r['ms_per_result']:.3f}"] for r in result["rows"]])
    print(f"grouped / per result: {ratio(result['speedup'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, help="where the store goes (default: a temporary directory)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not 1 <= args.lines <= 100_000 or not 1 <= args.repeats <= 20:
        p.error("--lines takes 1 to 100000, --repeats 1 to 20")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = measure(Path(root), args.lines, args.repeats)
    by_mode = {r["mode"]: r for r in rows}
    return emit(args, {"lines": args.lines, "repeats": args.repeats, "dir": str(args.dir or tempfile.gettempdir()),
                       "rows": rows, "speedup": by_mode["grouped"]["results_per_s"]
                       / by_mode["per result"]["results_per_s"]}, show)


if __name__ == "__main__":
    sys.exit(main())
