"""A token worker of a sliding-window model importing long prompts: its windowed layer groups
reserving only the blocks the first decode reaches (what the engine does:
`BlockManager.reserve_for_import`) against reserving every block of the prompt and releasing the
ones out of reach when the import completes (`whole`, as before): how many imports land at once,
how long a request waits for its second token, and what that does to the token worker's throughput.

The model is the demo's shape as a Mistral with a --window on every layer (or on every other one,
`--layers alternate`), dummy weights, unless --model names a checkpoint directory with windows. A
prompt engine prefills every prompt once; their KV and first tokens are then handed to a token
engine (token policy, `max_num_seqs` = the number of requests, KV blocks for --fit sequences'
whole prompt and output) as a token worker takes them: every request arrives at once (a forced
output length) and is reserved, in order, as soon as its reservation fits, as placement does before
the prompt worker prefills it; the prompt worker prefills the reserved ones in order, one each
--prefill-steps decode steps, and each lands (its KV copied into the reserved blocks) then, or at
once when nothing decodes. Both layouts run side by side in one process, interleaved after a
warm-up, medians with [min-max] over --repeats; their greedy tokens must be equal (the script
fails if not). The clock counts the token engine only (reservations, KV copies, decode steps).

    python scripts/bench_windowed_imports.py --json imports.json            # on CPU, float32
    python scripts/bench_windowed_imports.py --layers alternate --json imports-alternate.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

from bench_kv_cache_dtype import interleaved, summary  # this script's folder
from bench_sliding_window_kv import windowed_checkpoint
from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_model_config
from splitserve.engine.policies import make_policy
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.machine import cpu_name
from splitserve.transfer.codec import pack_all, slot_index, unpack_all

LAYOUTS = ("window", "whole")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint directory with sliding windows (default: the demo's shape as a "
                                   "Mistral with --window, dummy weights)")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--layers", choices=("every", "alternate"), default="every",
                   help="the demo Mistral's layers with the window: every one, or every other one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--fit", type=int, default=2, help="sequences whose whole length the token worker's KV holds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-steps", type=int, default=4,
                   help="decode steps the prompt worker takes to prefill and send one prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.window, args.requests, args.prompt_len, args.output_len, args.fit, args.repeats, args.threads,
           args.prefill_steps) < 1:
        p.error("--window, --requests, --prompt-len, --output-len, --fit, --repeats, --threads and --prefill-steps "
                "must be >= 1")
    return args


class WholeImports(BlockManager):
    """The block manager as it reserved an import before: every block of the prompt in every group."""

    def reserve_for_import(self, seq, reuse_prefix: bool = False, others_growth: int = 0) -> list[list[int]]:
        self.allocate(seq, use_prefix_cache=reuse_prefix)
        return self.export_blocks(seq.seq_id)


def engine_args(args, model: str) -> dict:
    return dict(device=args.device, dtype=args.dtype, load_format="auto" if args.model else "dummy",
                block_size=args.block_size, max_model_len=args.prompt_len + args.output_len + args.block_size,
                enable_prefix_caching=False)


def prefill(args, model: str, prompts: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
    """Each prompt's KV on the wire and its first token, from a prompt engine."""
    engine = LLMEngine(model, policy="prompt", prompt_token_budget=args.prompt_len, max_num_seqs=len(prompts),
                       **engine_args(args, model))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    handed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seq, blocks = engine.export_request(out.request_id)
            cache = engine.kv_cache
            slots = slot_index(blocks, cache.block_size, seq.num_prompt_tokens, cache.data.device)
            handed[out.request_id] = (pack_all(cache, slots), out.token_ids[0])
            engine.release_request(out.request_id)
    return [handed[str(i)] for i in range(len(prompts))]


def run(args, model: str, layout: str, prompts: list[list[int]], handed: list[tuple[torch.Tensor, int]]) -> dict:
    groups = kv_groups(load_model_config(model)).num_groups  # a token block takes a block of each
    blocks = args.fit * groups * -(-(args.prompt_len + args.output_len) // args.block_size) + 1  # + NULL_BLOCK
    engine = LLMEngine(model, policy="token", num_kv_blocks=blocks, max_num_seqs=len(prompts),
                       **engine_args(args, model))
    if layout == "whole":
        bm = engine.block_manager
        engine.block_manager = WholeImports(bm.num_blocks + 1, bm.block_size, bm.enable_prefix_caching,
                                            windows=bm.windows)  # + NULL_BLOCK
        engine.policy = make_policy("token", engine.block_manager, engine.policy.limits)
    return drive(engine, prompts, handed, args.output_len, args.prefill_steps)


def drive(engine: LLMEngine, prompts: list[list[int]], handed: list[tuple[torch.Tensor, int]], output_len: int,
          prefill_steps: int) -> dict:
    """Reserve the imports in order while they fit; land the oldest reserved one each
    `prefill_steps` decode steps (at once when nothing decodes); step; until every request is
    done. Times each request's second token from the start."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    cache, pending, reserved = engine.kv_cache, list(range(len(prompts))), deque()
    gc.collect()
    tables, running, done, second, next_landing = {}, [], {}, {}, prefill_steps
    start = time.perf_counter()
    while pending or reserved or engine.has_unfinished_requests():
        while pending:
            try:
                _, tables[pending[0]] = engine.reserve_import(str(pending[0]), prompts[pending[0]], params)
            except (OutOfBlocksError, EngineFullError):
                break
            reserved.append(pending.pop(0))
        if reserved and (len(running) >= next_landing or not engine.has_unfinished_requests()):
            i = reserved.popleft()
            unpack_all(cache, slot_index(tables.pop(i), cache.block_size, len(prompts[i]), cache.data.device),
                       handed[i][0])
            engine.complete_import(str(i), handed[i][1])
            next_landing = len(running) + prefill_steps
        outputs = engine.step()
        now = time.perf_counter() - start
        running.append(len(engine.policy.running))
        for out in outputs:
            second.setdefault(out.request_id, now)
        done.update((out.request_id, out.outputs[0].token_ids) for out in outputs if out.finished)
    seconds = time.perf_counter() - start
    waits = statistics.quantiles(second.values(), n=10, method="inclusive") if len(second) > 1 else [seconds] * 9
    return {"seconds": seconds, "output_tokens_per_s": len(prompts) * output_len / seconds,
            "second_token_p50_s": waits[4], "second_token_p90_s": waits[8], "kv_blocks": cache.num_blocks,
            "peak_running": max(running), "mean_running": statistics.mean(running), "steps": len(running),
            "preemptions": engine.policy.num_preemptions, "tokens": [done[str(i)] for i in range(len(prompts))]}


def row_of(runs: list[dict]) -> dict:
    return {"kv_blocks": runs[0]["kv_blocks"], "peak_running": runs[0]["peak_running"],
            **{key: summary([r[key] for r in runs]) for key in ("mean_running", "preemptions", "steps",
                                                                 "second_token_p50_s", "second_token_p90_s",
                                                                 "output_tokens_per_s")}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as scratch:
        model = windowed_checkpoint(args, scratch)
        handed = prefill(args, model, prompts)
        runs = interleaved(LAYOUTS, args.repeats, prompts,
                           lambda layout, some: run(args, model, layout, some, handed[:len(some)]))
        window = max(w or 0 for w in kv_groups(load_model_config(model)).windows)
    if any(r["tokens"] != runs["window"][0]["tokens"] for rs in runs.values() for r in rs):
        raise SystemExit("the layouts' greedy tokens differ: the reservation changed what attention read")
    rows = {layout: row_of(r) for layout, r in runs.items()}
    ratio = rows["window"]["output_tokens_per_s"]["median"] / rows["whole"]["output_tokens_per_s"]["median"]
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "hardware": {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()},
              "window": window, "layouts": rows, "throughput_ratio_window_vs_whole": ratio}
    print(f"token worker KV: {rows['window']['kv_blocks']} blocks of {args.block_size} ({args.fit} sequences of "
          f"{args.prompt_len + args.output_len} tokens); window {window} on {args.layers} layer; "
          f"{args.requests} imports of {args.prompt_len}-token prompts at once")
    print("| reservation | blocks | peak running | mean running | preemptions | steps | 2nd token p50 / p90 s | "
          "output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        tps = row["output_tokens_per_s"]
        print(f"| {name} | {row['kv_blocks']} | {row['peak_running']} | {row['mean_running']['median']:.1f} | "
              f"{row['preemptions']['median']:.0f} | {row['steps']['median']:.0f} | "
              f"{row['second_token_p50_s']['median']:.2f} / {row['second_token_p90_s']['median']:.2f} | "
              f"{tps['median']:.0f} [{tps['min']:.0f}-{tps['max']:.0f}] |")
    print(f"window / whole throughput: {ratio:.2f}x; greedy tokens equal")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
