"""What serving more LoRA adapters than slots costs: one workload through an engine with a slot for
every adapter, and through one with --slots slots that holds the rest in host memory
(`max_cpu_loras`), an adapter copied into a slot as its request is admitted.

    python scripts/bench_lora_swap.py                        # this CPU, a small Llama shape
    python scripts/bench_lora_swap.py --repeats 3 --json lora-swap.json
    python scripts/bench_lora_swap.py --shape llama3-8b --device cuda --json lora-swap.json

Requests of --prompt tokens generating --tokens each arrive one every --every engine steps (counted
in steps, so both engines see the same workload), each under one of --adapters adapters drawn with
Zipf popularity (--skew; 0: uniform), as many tenants' traffic is; every adapter rank --rank on all
seven dense projections, dummy weights (no download). TTFT is wall-clock time from a request's
arrival to its first token; a swap's time is the copy into a slot, timed around it (on CUDA after a
synchronize). --patience sets when a waiting adapter claims a slot (`lora_residency`). Greedy,
mixed policy, prefix caching off; every request's output must be the same under both. The engines
run in turn, --repeats times; a row reports the median run and the range.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_lora import SMALL  # this script's folder
from bench_moe import emit, print_markdown, ratio, spread, summarize_runs

from splitserve.bench.report import percentiles
from splitserve.engine.config import ModelConfig
from splitserve.engine.dummy_adapter import projection_shapes, write_adapter
from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.shapes import SHAPES

FIGURES = ("total_s", "ttft_p50_s", "ttft_p99_s", "swaps", "swap_p50_s")


def workload(args) -> list[tuple[int, str, list[int]]]:
    """Per request: its arrival step, its adapter, its prompt."""
    rng = random.Random(args.seed)
    weights = [1 / (i + 1) ** args.skew for i in range(args.adapters)]
    names = rng.choices([f"a{i}" for i in range(args.adapters)], weights, k=args.requests)
    return [(i * args.every, name, [rng.randrange(3, 8000) for _ in range(args.prompt)])
            for i, name in enumerate(names)]


def run(model_dir: str, adapters: dict[str, str], slots: int, requests: list, args) -> dict:
    engine = LLMEngine(model_dir, load_format="dummy", device=args.device, enable_prefix_caching=False,
                       lora_modules=adapters, max_loras=slots, max_cpu_loras=len(adapters), max_lora_rank=args.rank,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.prompt + args.tokens + 8)
    residency, swap_times = engine.policy.adapters, []
    if args.patience is not None:
        residency.patience = args.patience
    write = residency.write

    def timed_write(slot: int, identity: str) -> None:
        start = time.perf_counter()
        write(slot, identity)
        if args.device == "cuda":
            torch.cuda.synchronize()
        swap_times.append(time.perf_counter() - start)

    residency.write = timed_write
    params = {name: SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False,
                                   lora=name) for name in adapters}
    arrived, first, outputs, pending, steps = {}, {}, {}, list(requests), 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            _, name, prompt = pending.pop(0)
            request_id = f"r{len(arrived)}"
            engine.add_request(request_id, prompt, params[name])
            arrived[request_id] = time.perf_counter()
        steps += 1
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    total = time.perf_counter() - start
    ttft = percentiles([first[r] - arrived[r] for r in arrived], (50, 99))
    return {"slots": slots, "total_s": total, "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "swaps": residency.swaps, "swap_p50_s": statistics.median(swap_times) if swap_times else 0.0,
            "steps": steps, "outputs": outputs}


def summarize(runs: list[dict], layouts: list[int]) -> list[dict]:
    """Per slot count: each figure's median over the repeats, with its range; against every adapter in a slot."""
    rows = summarize_runs(runs, "slots", layouts, FIGURES)
    resident = rows[0]
    for row in rows:
        row["same_outputs"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
        for key in ("total_s", "ttft_p50_s", "ttft_p99_s"):
            row[f"{key}_vs_resident"] = row[key]["median"] / resident[key]["median"]
    return rows


def show(result: dict) -> None:
    print_markdown(["slots", "total s:", "vs all resident:", "TTFT p50 ms:", "TTFT p99 ms:", "swaps:",
                    "swap ms (p50):"],
                   [[r["slots"], spread(r["total_s"], digits=2), ratio(r["total_s_vs_resident"]),
                     spread(r["ttft_p50_s"], 1000), spread(r["ttft_p99_s"], 1000), spread(r["swaps"]),
                     spread(r["swap_p50_s"], 1000, 2)] for r in result["rows"]])
    print(f"\nevery request's output the same in every run: {result['rows'][0]['same_outputs']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", choices=["small", *SHAPES], help="the model's shape (small: "
                   "Llama-3's, 1024 wide and 4 layers deep)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--slots", default="4,2", help="slot counts to compare with one slot per adapter")
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the adapters' popularity (0: uniform)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--every", type=int, default=2, help="engine steps between arrivals")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--patience", type=int, default=None, help="sequences of other adapters that may take slots "
                   "before a waiting adapter claims one (default: the engine's, --max-num-seqs; 0: at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    for name in ("adapters", "rank", "requests", "prompt", "tokens", "every", "max_num_seqs", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    layouts = [args.adapters] + [int(s) for s in args.slots.split(",")]
    if not all(0 < s <= min(args.adapters, 64) for s in layouts):
        p.error(f"--slots must be from 1 to --adapters ({args.adapters}, at most 64), got {args.slots}")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device takes cpu, or cuda where there is one; got {args.device}")
    shape = SMALL if args.shape == "small" else SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_shape_checkpoint(Path(tmp) / "model", shape))
        config = ModelConfig.from_hf(shape)
        adapters = {f"a{i}": str(write_adapter(Path(tmp) / f"a{i}", config, list(projection_shapes(config)),
                                               args.rank, i)) for i in range(args.adapters)}
        requests = workload(args)
        runs = [run(model_dir, adapters, slots, requests, args) for _ in range(args.repeats) for slots in layouts]
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    result = {"device": device, "shape": args.shape, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "args": {k: str(v) for k, v in vars(args).items()}, "rows": summarize(runs, layouts),
              "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    return emit(args, result, show)


if __name__ == "__main__":
    sys.exit(main())
