"""A sliding-window model's prefill of one long prompt on the torch attention path (the CPU path),
attending a tile of queries at a time, each to the keys within its window (`tiles`: what the engine
does), against one band mask over the whole prompt (`one band`: the engine before the tiles), and
the same shape with no window (`no window`: SDPA's causal kernel, the reference cost).

The shape is bench_kv_transfer.py's larger one (8 layers, hidden 512, dummy weights) with a
--window on seven of its eight layers. One engine per case in this process, interleaved after a
warm-up, medians with [min-max] over --repeats of the prefill step alone. The two windowed cases
must sample the same first token (the script fails if not).

    python scripts/bench_window_prefill.py --json window-prefill.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_kv_transfer import LARGER, windowed  # this script's folder
from splitserve.engine.attention import torch_paged
from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.machine import cpu_name

CASES = ("tiles", "one band", "no window")


def prefill_s(engine: LLMEngine, prompt: list[int], tiles: bool) -> tuple[float, int]:
    """Seconds of the prefill step and its first token; `tiles` False attends the prompt in one tile."""
    saved = torch_paged.QUERY_TILE, torch_paged.MIN_TILE
    if not tiles:
        torch_paged.QUERY_TILE = torch_paged.MIN_TILE = 1 << 30
    try:
        engine.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        [out] = engine.step()
        return time.perf_counter() - start, out.token_ids[0]
    finally:
        torch_paged.QUERY_TILE, torch_paged.MIN_TILE = saved


def measure(args, folder: Path) -> list[dict]:
    longest = max(args.lens)
    shapes = {"windowed": windowed(args.window), "no window": LARGER}
    engines = {}
    for name, shape in shapes.items():
        model = write_shape_checkpoint(folder / name.replace(" ", "-"),
                                       {**shape, "max_position_embeddings": longest + 64})
        engines[name] = LLMEngine(model, load_format="dummy", device="cpu", dtype="float32",
                                  max_model_len=longest + 64, enable_prefix_caching=False, policy="prefill_first")
    runs = {"tiles": (engines["windowed"], True), "one band": (engines["windowed"], False),
            "no window": (engines["no window"], True)}
    rows = []
    for n in args.lens:
        prompt = [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]
        times, firsts = {case: [] for case in CASES}, {}
        for case in CASES:  # warm-up
            engine, tiles = runs[case]
            prefill_s(engine, prompt, tiles)
        for _ in range(args.repeats):
            for case in CASES:
                engine, tiles = runs[case]
                seconds, firsts[case] = prefill_s(engine, prompt, tiles)
                times[case].append(seconds)
        if firsts["tiles"] != firsts["one band"]:
            raise SystemExit(f"{n} tokens: tiles sampled {firsts['tiles']}, one band {firsts['one band']}")
        for case in CASES:
            rows.append({"case": case, "prompt_tokens": n, "window": args.window,
                         "prefill_ms": statistics.median(times[case]) * 1e3,
                         "min_ms": min(times[case]) * 1e3, "max_ms": max(times[case]) * 1e3,
                         "repeats": args.repeats})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", default="2048,4096,8192", help="comma-separated prompt lengths")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    args.lens = [int(x) for x in args.lens.split(",") if x.strip().isdigit()]
    if not args.lens or min(args.lens) < 2 or args.window < 1 or args.repeats < 1:
        p.error("--lens takes prompt lengths >= 2, --window and --repeats integers >= 1")
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(args, Path(folder))
    print(f"Hardware: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"window {args.window} on 7 of 8 layers\n")
    print("| case | prompt tokens | prefill ms [min-max] | / no window |")
    print("|---|---:|---:|---:|")
    reference = {r["prompt_tokens"]: r["prefill_ms"] for r in rows if r["case"] == "no window"}
    for r in rows:
        print(f"| {r['case']} | {r['prompt_tokens']} | {r['prefill_ms']:.0f} [{r['min_ms']:.0f}-{r['max_ms']:.0f}] "
              f"| {r['prefill_ms'] / reference[r['prompt_tokens']]:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
