"""Throughput with and without JSON-schema decoding, on the demo model (CPU), in one process.

The same N requests (random byte prompts, seeded sampling) run through one offline engine twice
per repeat, free and constrained to a JSON schema, interleaved (free, schema, free, schema, ...),
C in flight (`max_num_seqs`). Free requests run to --max-tokens; constrained ones stop when their
JSON is complete, so the measure is output tokens per second, not requests. Every constrained
output is checked: it parses and validates against the schema (`jsonschema`) unless it ran out of
tokens. Reported: median tokens/s of each mode (min-max), and constrained / free.

    python scripts/bench_structured.py                 # ~1 min on 2 cores
    python scripts/bench_structured.py --requests 32 --repeats 1 --json rows.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from splitserve.engine.llm import LLM
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 8}}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96, help="requests per run (96)")
    p.add_argument("--in-flight", type=int, default=32, help="requests in flight: the engine's max_num_seqs (32)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (64)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens of a free request; a constrained one's cap (96)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved free/schema pairs (3)")
    p.add_argument("--json", help="write the rows (one per run) here")
    return p.parse_args(argv)


def run(llm: LLM, prompts: list[list[int]], args, constrained: bool) -> dict:
    constraint = OutputConstraint.of("json_schema", SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=args.max_tokens, seed=i, constraint=constraint) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    if constrained:
        for out in outputs:
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMA)
    return {"mode": "json_schema" if constrained else "free", "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "finished_by_stop": sum(o.finish_reason == "stop" for o in outputs),
            "requests": len(outputs), "in_flight": args.in_flight}


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    llm = LLM("demo", max_num_seqs=args.in_flight, enable_prefix_caching=False)
    run(llm, prompts[:args.in_flight], args, constrained=True)  # warm-up: kernels, the grammar tokenizer
    rows = [run(llm, prompts, args, constrained) for _ in range(args.repeats) for constrained in (False, True)]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.requests} requests, {args.in_flight} in flight, prompts {args.prompt_len} tokens")
    medians = {}
    for mode in ("free", "json_schema"):
        rates = [r["tokens_per_s"] for r in rows if r["mode"] == mode]
        medians[mode] = statistics.median(rates)
        stops = [r["finished_by_stop"] for r in rows if r["mode"] == mode]
        print(f"{mode:12s} {medians[mode]:8.1f} output tokens/s (min {min(rates):.1f}, max {max(rates):.1f}); "
              f"{min(stops)}-{max(stops)} of {args.requests} ended by EOS")
    print(f"json_schema / free: {medians['json_schema'] / medians['free']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
