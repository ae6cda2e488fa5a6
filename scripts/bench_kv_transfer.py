"""KV transfer from a prompt worker to a token worker, against a colocated engine (CPU).

Two processes per backend (`kv_pair.py`, where every column is defined), one torch thread each:
`gloo` sends the KV over a gloo pair on loopback, `ipc` writes it straight into the token worker's
cache in shared memory (the same-node path; CUDA IPC on GPUs). Per prompt length, median of
--repeats runs, the backends interleaved. The windowed shape is the larger one with a --window on
seven of its eight layers (Gemma 3's pattern): its windowed layers send only what the token
worker's first decode reaches ("MB sent", measured at the prompt worker).

    python scripts/bench_kv_transfer.py --json kv.json           # demo model, the larger and windowed shapes
    python scripts/bench_kv_transfer.py --backends ipc --quick    # smoke run of one backend
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from kv_pair import Pair, kv_bytes_per_token, measure

from splitserve.engine.dummy_weights import write_shape_checkpoint

LARGER = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4160,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def windowed(window: int) -> dict:
    """LARGER as a Mistral whose layers all slide but the sixth (one full layer in a run of six)."""
    kinds = ["full_attention" if layer % 6 == 5 else "sliding_attention"
             for layer in range(LARGER["num_hidden_layers"])]
    return {**LARGER, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window,
            "layer_types": kinds}


def engine_args(model: str) -> dict:
    args = {"device": "cpu", "dtype": "float32", "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 30}
    return args if model == "demo" else {**args, "load_format": "dummy"}


def print_table(rows: list[dict]) -> None:
    print(f"Hardware: {os.cpu_count()} CPU cores, torch {torch.__version__}; gloo over loopback, ipc through shared "
          "memory; 1 thread per worker\n")
    print("| backend | model | prompt tokens | KV MB | MB sent | prefill ms | serialized transfer ms "
          "| visible transfer ms | visible / serialized | TTFT ms (coloc) | 2nd token ms (coloc) "
          "| 2nd token overhead |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['model']} | {r['prompt_tokens']} | {r['kv_bytes'] / 2**20:.1f} "
              f"| {r['sent_bytes'] / 2**20:.1f} | {r['prefill_ms']:.1f} "
              f"| {r['serialized_transfer_ms']:.2f} | {r['visible_transfer_ms']:.2f} | {r['visible_fraction']:.0%} "
              f"| {r['ttft_ms']:.1f} ({r['colocated_ttft_ms']:.1f}) | {r['second_token_ms']:.2f} "
              f"({r['colocated_second_token_ms']:.2f}) | {r['second_token_overhead']:+.0%} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="demo model, two short prompts, one repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demo-lens", default="128,256,512,1024,2000", help="'' skips the demo model")
    p.add_argument("--larger-lens", default="128,512,1024,2048,4096", help="'' skips the larger dummy shape")
    p.add_argument("--windowed-lens", default="1024,2048,4096", help="'' skips the windowed dummy shape")
    p.add_argument("--window", type=int, default=1024, help="the windowed shape's sliding window (tokens)")
    p.add_argument("--backends", default="gloo,ipc", help="comma-separated, measured interleaved: gloo, ipc")
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    if not backends or set(backends) - {"gloo", "ipc"}:
        p.error(f"--backends takes gloo and/or ipc, got {args.backends!r}")
    if args.quick:
        args.repeats, args.demo_lens, args.larger_lens, args.windowed_lens, args.window = 1, "128,600", "", "600", 128
    tmp = tempfile.TemporaryDirectory()
    shapes = {"larger (dummy)": LARGER, f"windowed {args.window} (dummy)": windowed(args.window)}
    runs = [(name, lens) for name, lens in (("demo", args.demo_lens), *zip(shapes, (args.larger_lens,
                                                                                   args.windowed_lens))) if lens]
    rows = []
    for name, lens in runs:
        model = name if name == "demo" else write_shape_checkpoint(Path(tmp.name) / name.split()[0], shapes[name])
        pairs = [Pair(model, backend, engine_args(model)) for backend in backends]
        try:
            for n in (int(x) for x in lens.split(",")):
                for row in measure(pairs, model, n, args.repeats, kv_bytes_per_token(model, 4)):
                    rows.append({**row, "model": name})
        finally:
            for pair in pairs:
                pair.close()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
