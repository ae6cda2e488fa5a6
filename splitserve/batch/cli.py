"""`splitserve batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI Batch API input file run offline on one
engine in BlendServe order. Rerun the same command after a crash: lines already in OUTPUT (or in
the error file) are kept and not run again."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from splitserve.api import chat_parsers
from splitserve.api.request_models import ServedModels
from splitserve.batch.blend.feeder import ORDERS, BlendOptions
from splitserve.command import add_lora_modules, report_errors
from splitserve.engine.attention.fp8_kv import KV_CACHE_DTYPES
from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import MAX_KV_BLOCKS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", type=Path, help="batch input (JSONL: custom_id, method, url, body per line)")
    p.add_argument("output", type=Path, help="results (JSONL, OpenAI batch output lines); resumed if it exists")
    p.add_argument("--errors", type=Path, default=None, help="failed lines (default: OUTPUT with .errors.jsonl)")
    p.add_argument("--model", default="demo", help='"demo" (built-in) or a Hugging Face checkpoint directory')
    p.add_argument("--served-model-name", default=None, help="the name the lines' body.model must use "
                                                                 "(default: --model)")
    p.add_argument("--order", default="blend", choices=ORDERS, help="blend (BlendServe), dfs (prefix tree "
                                                                   "depth-first) or fcfs (input order)")
    p.add_argument("--sample-fraction", type=float, default=0.01, help="requests run first to learn output lengths")
    p.add_argument("--split-threshold", type=float, default=0.01,
                   help="node-split recompute budget, as a fraction of the unique prompt tokens")
    p.add_argument("--num-kv-blocks", type=_kv_blocks, default=None,
                   help=f"KV cache size, at most {MAX_KV_BLOCKS} (default: from memory)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (the serving dtype) or fp8: K and V stored as float8 e4m3 codes, twice the tokens")
    p.add_argument("--device", default="auto")
    p.add_argument("--stats", type=Path, default=None, help="write the run's statistics here (JSON)")
    p.add_argument("--score-label-tokens", nargs="+", default=None, metavar="TOKEN",
                   help="a reranker that answers in tokens (Qwen3-Reranker: no yes): score and rerank lines run "
                        "each pair as one prompt, scored by the last token's probability (default: by embeddings)")
    add_lora_modules(p, " (a line's body.model)")
    chat_parsers.add_arguments(p, config_fallback=False)


def _kv_blocks(text: str) -> int:
    try:
        blocks = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= blocks <= MAX_KV_BLOCKS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_KV_BLOCKS}], got {blocks}")
    return blocks


def run_command(args) -> int:
    return report_errors("batch", _run, args, (ValueError, OSError, ConfigError))


def _run(args) -> None:
    from tqdm import tqdm

    from splitserve.batch.engine_executor import run_lines
    from splitserve.batch.lines import parse_input
    from splitserve.api.score_request import label_token_ids
    from splitserve.batch.results import ResultLog
    from splitserve.engine.llm_engine import LLMEngine

    errors_path = args.errors or args.output.with_name(args.output.name.removesuffix(".jsonl") + ".errors.jsonl")
    _check_distinct({"INPUT": args.input, "OUTPUT": args.output, "the errors file": errors_path})
    lines = parse_input(args.input.read_bytes())
    options = BlendOptions(args.order, args.sample_fraction, args.split_threshold)
    adapters = dict(args.lora_modules or ())
    served = ServedModels((args.served_model_name or args.model,), tuple(adapters))  # ValueError on a clash
    engine = LLMEngine(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                       num_kv_blocks=args.num_kv_blocks, lora_modules=adapters)
    labels = label_token_ids(engine.tokenizer, args.score_label_tokens or ())  # ValueError on a label of two tokens
    with ResultLog(args.output) as output, ResultLog(errors_path) as errors:
        done = len(output.done) + len(errors.done)
        if done:
            print(f"resuming: {done} of {len(lines)} lines already have results")
        with tqdm(total=len(lines), initial=done, desc="batch", unit="line") as bar:
            stats = run_lines(engine, lines, served, output, errors, options,
                              on_result=lambda ok: bar.update(),
                              parsers=chat_parsers.from_arguments(args), score_labels=labels)
        failed = len(errors.done)
    print(f"{len(lines) - failed} lines succeeded, {failed} failed -> {args.output}"
          + (f", {errors_path}" if failed else ""))
    print(f"this run: {stats.requests} requests, {stats.prompt_tokens} prompt tokens ({stats.sharing:.1%} from the "
          f"prefix cache), {stats.output_tokens} output tokens, {stats.throughput:.0f} tokens/s over "
          f"{stats.engine_s:.2f} s of engine steps ({args.order} order)")
    if args.stats:
        summary = {key: value for key, value in vars(stats).items() if key != "step_density"}
        args.stats.write_text(json.dumps({**summary, "throughput": stats.throughput, "sharing": stats.sharing},
                                         indent=2))


def _check_distinct(paths: dict[str, Path]) -> None:
    """The input, the output and the errors file must be three files: a result log reads what its
    file holds as results (an input taken for one lost its lines and was written over)."""
    seen: dict[Path, str] = {}
    for name, path in paths.items():
        real = path.resolve()
        if real in seen:
            raise ValueError(f"{name} ({path}) is the same file as {seen[real]}: give each its own path")
        seen[real] = name
