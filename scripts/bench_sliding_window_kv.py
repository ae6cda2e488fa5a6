"""A model with sliding windows in the same KV memory, its windowed layers keeping a window's blocks
of each sequence (what the engine does: `BlockManager(windows=...)`) against `--against`: keeping
every block (`whole`), or keeping a window's but taking all of a prompt's blocks when it is
admitted (`prompts-whole`) rather than chunk by chunk as the engine does: how many sequences run at
once, how often one is preempted, how soon first tokens come, and what that does to throughput.

The model is the demo's shape as a Mistral with a --window on every layer (Mistral's layout) or
on every other one (`--layers alternate`: Gemma 2's and GPT-OSS's, two layer groups), dummy
weights, unless --model names a checkpoint directory with windows. One engine per layout (mixed policy, `max_num_seqs`
= the number of requests, so only the KV cache limits the batch), the same KV blocks for both:
enough for --fit sequences' whole prompt and output. Every request is sent at once with a forced
output length. The engines run side by side in one process, interleaved (window, whole, ...)
after a warm-up, medians with [min-max] over --repeats. Releasing blocks changes no arithmetic, so
the two layouts' greedy tokens must be equal; the script fails if they are not.

    python scripts/bench_sliding_window_kv.py --json window.json          # on CPU, float32
    python scripts/bench_sliding_window_kv.py --layers alternate --json window-alternate.json
    python scripts/bench_sliding_window_kv.py --against prompts-whole --prompt-len 1024 --output-len 256 \
        --chunk 128 --fit 2 --requests 16 --json window-prompts.json
    python scripts/bench_sliding_window_kv.py --model /path/to/mistral --device cuda --dtype bfloat16 --fit 64
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from bench_kv_cache_dtype import drive, interleaved, print_rows, row_of  # this script's folder
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.demo import DEMO_MODEL_CONFIG
from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_model_config
from splitserve.engine.policies import make_policy
from splitserve.engine.policies.mixed import MixedPolicy
from splitserve.machine import cpu_name

KINDS = {"every": ("sliding_attention",) * 2, "alternate": ("full_attention", "sliding_attention")}


def window_args(p: argparse.ArgumentParser, requests: int, prompt_len: int, output_len: int, fit: int) -> None:
    """The options of the sliding-window benches (this one and bench_windowed_imports.py)."""
    p.add_argument("--model", help="a checkpoint directory with sliding windows (default: the demo's shape as a "
                                   "Mistral with --window, dummy weights)")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--layers", choices=("every", "alternate"), default="every",
                   help="the demo Mistral's layers with the window: every one, or every other one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--fit", type=int, default=fit, help="sequences whose whole length the KV blocks hold")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    p.add_argument("--json", type=Path)


def parsed(p: argparse.ArgumentParser, argv: list[str] | None, positive: tuple[str, ...]) -> argparse.Namespace:
    """`p`'s arguments; exits naming them unless `window_args`' counts and `positive` are all >= 1."""
    args = p.parse_args(argv)
    names = ("window", "requests", "prompt_len", "output_len", "fit", "repeats", "threads", *positive)
    if min(getattr(args, name) for name in names) < 1:
        p.error(", ".join("--" + name.replace("_", "-") for name in names) + " must be >= 1")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_args(p, requests=32, prompt_len=128, output_len=384, fit=8)
    p.add_argument("--against", choices=("whole", "prompts-whole"), default="whole",
                   help="the layout the engine's is measured against: every block kept, or a prompt's taken at once")
    p.add_argument("--chunk", type=int, default=512, help="the mixed policy's token budget (chunk_token_budget)")
    return parsed(p, argv, ("chunk",))


def windowed_checkpoint(args, scratch: str) -> str:
    """`--model`, or the demo's shape as a Mistral with `--window` on `--layers` (dummy weights);
    exits if no layer group has a window."""
    model = args.model or write_shape_checkpoint(scratch, {
        **DEMO_MODEL_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "sliding_window": args.window, "max_position_embeddings": args.prompt_len + args.output_len + 64,
        "layer_types": [kind for _ in range(DEMO_MODEL_CONFIG["num_hidden_layers"] // 2)
                        for kind in KINDS[args.layers]]})
    if all(w is None for w in kv_groups(load_model_config(model)).windows):
        raise SystemExit(f"{model}: no layer group has a sliding window, so there is nothing to release")
    return model


def keep_every_block(engine: LLMEngine) -> None:
    """The engine as it was before windows released blocks: a block manager whose layer groups
    have no window (which also hands out NULL_BLOCK, one block more)."""
    engine.block_manager = BlockManager(engine.kv_cache.num_blocks, engine.config.block_size,
                                        engine.config.enable_prefix_caching,
                                        windows=(None,) * engine.block_manager.num_groups)
    engine.policy = make_policy(engine.config.policy, engine.block_manager, engine.policy.limits)


class PromptsWholeMixed(MixedPolicy):
    """The mixed policy as it admitted a prompt before: with every one of its blocks."""

    prefill_chunk_tokens = None


def run(args, model: str, layout: str, prompts: list[list[int]]) -> dict:
    groups = kv_groups(load_model_config(model)).num_groups  # a token block takes a block of each
    blocks = args.fit * groups * -(-(args.prompt_len + args.output_len) // args.block_size) + 1  # + NULL_BLOCK
    engine = LLMEngine(model, device=args.device, dtype=args.dtype, load_format="auto" if args.model else "dummy",
                       policy="mixed", num_kv_blocks=blocks, block_size=args.block_size, max_num_seqs=len(prompts),
                       max_model_len=args.prompt_len + args.output_len + args.block_size, enable_prefix_caching=False,
                       chunk_token_budget=args.chunk)
    window = max(w or 0 for w in engine.block_manager.windows)
    if layout == "whole":
        keep_every_block(engine)
    elif layout == "prompts-whole":
        engine.policy = PromptsWholeMixed(engine.block_manager, engine.policy.limits)
    return {**drive(engine, prompts, args.output_len), "window": window}


def prompts_for(args) -> list[list[int]]:
    """--requests random prompts of --prompt-len tokens (the same every run), torch on --threads."""
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = prompts_for(args)
    with tempfile.TemporaryDirectory() as scratch:
        model = windowed_checkpoint(args, scratch)
        layouts = ("window", args.against)
        runs = interleaved(layouts, args.repeats, prompts, lambda layout, some: run(args, model, layout, some))
    window = runs["window"][0]["window"]
    return report(args, runs, args.against, "layout", "ttft", window,
                  f"KV cache: {runs['window'][0]['kv_blocks']} blocks of {args.block_size} ({args.fit} sequences of "
                  f"{args.prompt_len + args.output_len} tokens); window {window} on {args.layers} layer; "
                  f"{args.requests} requests at once; chunks of {args.chunk} tokens")


def report(args, runs: dict[str, list[dict]], against: str, label: str, first: str, window: int, heading: str) -> dict:
    """The layouts' rows (`label`: their column; `first`: `StepLog.result`'s) and the window /
    `against` throughput ratio, printed under `heading`, written to --json and returned; exits if
    the layouts' greedy tokens differ (which blocks are held must not change what attention reads)."""
    if any(r["tokens"] != runs["window"][0]["tokens"] for rs in runs.values() for r in rs):
        raise SystemExit("the layouts' greedy tokens differ: the blocks held changed what attention read")
    rows = {layout: row_of(r, first) for layout, r in runs.items()}
    ratio = rows["window"]["output_tokens_per_s"]["median"] / rows[against]["output_tokens_per_s"]["median"]
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "hardware": {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()},
              "window": window, "layouts": rows, f"throughput_ratio_window_vs_{against.replace('-', '_')}": ratio}
    print(heading)
    print_rows(rows, label, first)
    print(f"window / {against} throughput: {ratio:.2f}x; greedy tokens equal")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
