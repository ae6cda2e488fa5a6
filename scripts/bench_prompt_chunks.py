"""A prompt worker prefilling long prompts whole against in chunks (`prompt_chunk_tokens`), the KV
handed to a token worker over gloo (CPU): what chunking costs the time to first token, and how
much of the transfer stays visible when each chunk's layers stream as they land.

One prompt and token worker pair per chunk size (`kv_pair.py`, where every column is defined),
one torch thread each, their runs interleaved; the reference is a colocated engine prefilling the
prompt whole. The model is a dummy-weight Llama of the larger transfer bench's shape with a long
context. Medians of --repeats.

    python scripts/bench_prompt_chunks.py --json chunks.json
    python scripts/bench_prompt_chunks.py --lens 1024 --chunks 512 --repeats 1   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from bench_kv_transfer import LARGER, engine_args
from kv_pair import Pair, kv_bytes_per_token, measure

from splitserve.engine.dummy_weights import write_shape_checkpoint

WHOLE = 1 << 20  # a chunk no prompt reaches: prefilled in one step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", default="2048,4096,8192", help="prompt lengths (tokens)")
    p.add_argument("--chunks", default="4096,1024", help="prompt_chunk_tokens to compare with whole prompts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    lens, chunks = [int(x) for x in args.lens.split(",")], [int(x) for x in args.chunks.split(",")]
    if min(chunks) < 1 or min(lens) < 2:
        p.error("--chunks must be >= 1 and --lens >= 2")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_shape_checkpoint(Path(tmp) / "long", {**LARGER, "max_position_embeddings": max(lens) + 64})
        pairs = [Pair(model, "gloo", {**engine_args(model), "prompt_chunk_tokens": chunk},
                      "whole" if chunk == WHOLE else f"chunks of {chunk}") for chunk in (WHOLE, *chunks)]
        try:
            rows = [{**row, "chunks": row["backend"]} for n in lens
                    for row in measure(pairs, model, n, args.repeats, kv_bytes_per_token(model, 4))]
        finally:
            for pair in pairs:
                pair.close()
    print(f"Hardware: {os.cpu_count()} CPU cores, torch {torch.__version__}; gloo over loopback; "
          "1 thread per worker\n")
    print("| prompt tokens | prefill | TTFT ms (colocated, whole) | TTFT / colocated | serialized transfer ms "
          "| visible transfer ms | visible / serialized |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['chunks']} | {r['ttft_ms']:.0f} ({r['colocated_ttft_ms']:.0f}) "
              f"| {r['ttft_ms'] / r['colocated_ttft_ms']:.2f}x | {r['serialized_transfer_ms']:.1f} "
              f"| {r['visible_transfer_ms']:.1f} | {r['visible_fraction']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
