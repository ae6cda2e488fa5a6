"""One decoder layer's projections (QKV, o_proj, gate-up, down) of a dense model shape, in bf16
through torch's matmul (cuBLAS) and as FP8 codes in 128 x 128 blocks through the W8A16 Triton GEMM
(`fp8_linear.matmul`, as the CUDA engine runs an FP8 checkpoint's; `--scales row`: one scale a row,
as llm-compressor's FP8-dynamic releases store them) side by side: time at
decode and prefill token counts, what each reads per second against the HBM peak (MBU) and its
FLOPs against the dense bf16 peak (MFU), and each FP8 output's largest difference from its own
weights dequantized through cuBLAS (a check of the compiled kernel on the device). Where the
GEMM splits a decode tile over K (for the device's multiprocessors, or --multiprocessors), every
projection at that token count also runs unsplit ("fp8 unsplit"): what the split gains. Every
token count also runs the path the GEMM does not take there: the weight dequantized first, then
cuBLAS ("fp8 dequantized"), the tiled kernel ("fp8 tiled") and, where the device has FP8 tensor
cores (or on the CPU, interpreted), the activations quantized for W8A8 ("fp8 w8a8"; its difference
from bf16 is also the activations' rounding to e4m3, a few percent): where one overtakes another,
for `fp8_linear.PREFILL_TOKENS`. Each FP8 row names its `path`.

    python scripts/bench_fp8_linear.py --json fp8-linear.json    # CUDA: Qwen3-8B's layer
    python scripts/bench_fp8_linear.py --shape llama3-8b         # another dense shape of engine/shapes.py
    python scripts/bench_fp8_linear.py --tiny                    # tiny projections on the CPU (Triton's interpreter)

Bytes read = the weight (bf16: 2 a value; FP8: a code a value and a float32 scale a block) + the
input and output rows; FLOPs = 2 x tokens x inputs x outputs. Each row is the median of --iters
calls after a warm-up (CUDA events on a GPU); a `layer` row sums the four projections.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench_moe import (  # this script's folder
    add_run_args, device_peaks, emit, pct, print_markdown, ratio, run_device, sci, time_calls, token_counts,
)

from splitserve.engine import fp8
from splitserve.engine.config import ModelConfig
from splitserve.engine.shapes import SHAPES

BLOCK = (128, 128)  # Qwen3's and DeepSeek's FP8 releases' blocks
TOKENS = (1, 16, 64, 256, 2048, 8192)
TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
TINY_TOKENS = (1, 32)
TINY_BLOCK = (32, 128)  # blocks of whole W8A8 groups of columns


def projections(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """[outputs, inputs] of each projection of a layer (QKV and gate-up merged, as the engine runs them)."""
    heads, kv, d, hidden = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    return {"qkv": ((heads + 2 * kv) * d, hidden), "o_proj": (hidden, heads * d),
            "gate_up": (2 * c.intermediate_size, hidden), "down": (hidden, c.intermediate_size)}


def other_paths(taken: str, device: torch.device, block: tuple[int, int]) -> list[str]:
    """The FP8 paths a product does not take that `device` runs: W8A8 where it has FP8 tensor cores
    (or on the CPU, under Triton's interpreter) and the blocks whole groups of columns."""
    from splitserve.engine.model import fp8_linear, fp8_w8a8  # after TRITON_INTERPRET is settled

    return [path for path in fp8_linear.PATHS if path != taken and (path != "w8a8" or fp8_w8a8.runs_on(device, block))]


def measure(c: ModelConfig, tokens: list[int], iters: int, device: torch.device, dtype: torch.dtype,
            block: tuple[int, int], hbm: float | None, flops_peak: float | None, sms: int | None) -> list[dict]:
    """Rows of each projection and of the layer; `sms`: the multiprocessors decode tiles split for
    (None: the device's)."""
    from splitserve.engine.model import fp8_linear, split_k  # after TRITON_INTERPRET is settled

    sms = sms or split_k.multiprocessors(device)
    g, weights = torch.Generator().manual_seed(0), {}
    for name, shape in projections(c).items():
        scale_block = (1, shape[1]) if block == fp8.ROWS else block  # ROWS: one [rows, 1] scale a row
        codes, scales = fp8.quantize((torch.randn(shape, generator=g) * 0.02).to(device), scale_block)
        weights[name] = (codes, scales, fp8.dequantize(codes, scales, block, dtype))
    rows, cuda = [], device.type == "cuda"
    for t in tokens:
        layer = {}  # format: [seconds, bytes, flops]
        plans = {name: fp8_linear.split_plan(t, *codes.shape, block, sms)[0] for name, (codes, _, _) in weights.items()}
        for name, (codes, scales, dense) in weights.items():
            x = torch.randn(t, codes.shape[1], generator=g).to(device, dtype)
            splits = plans[name]
            calls = {"bf16": lambda: F.linear(x, dense),
                     "fp8": lambda: fp8_linear.matmul(x, codes, scales, block, splits=splits)}
            paths = {"fp8": fp8_linear.path_for(t, x, block)}
            if max(plans.values()) > 1:
                calls["fp8 unsplit"], paths["fp8 unsplit"] = \
                    lambda: fp8_linear.matmul(x, codes, scales, block, splits=1), "tiled"
            for path in other_paths(paths["fp8"], device, block):
                calls[f"fp8 {path}"], paths[f"fp8 {path}"] = \
                    lambda path=path: fp8_linear.matmul(x, codes, scales, block, splits=splits, path=path), path
            stored = codes.nbytes + scales.nbytes
            flops = 2 * t * codes.shape[0] * codes.shape[1]
            exact = calls["bf16"]().float()
            for fmt, call in calls.items():
                seconds = time_calls(call, iters, cuda)
                read = (dense.nbytes if fmt == "bf16" else stored) + x.nbytes + t * codes.shape[0] * x.element_size()
                rows.append(row(name, fmt, t, seconds, read, flops, hbm, flops_peak))
                layer[fmt] = [a + b for a, b in zip(layer.get(fmt, [0.0, 0, 0]), (seconds, read, flops))]
                if fmt != "bf16":
                    rows[-1]["path"] = paths[fmt]
                    rows[-1]["splits"] = None if paths[fmt] != "tiled" else 1 if fmt == "fp8 unsplit" else splits
                    rows[-1]["max_rel_diff"] = ((call().float() - exact).abs().max() / exact.abs().max()).item()
        rows += layer_rows(layer, t, hbm, flops_peak)
    return with_speedups(rows)


def layer_rows(layer: dict[str, list], tokens: int, hbm: float | None, flops_peak: float | None) -> list[dict]:
    """A `layer` row per format, of its projections' summed [seconds, bytes, flops] at `tokens`."""
    return [row("layer", fmt, tokens, seconds, read, flops, hbm, flops_peak)
            for fmt, (seconds, read, flops) in layer.items()]


def with_speedups(rows: list[dict]) -> list[dict]:
    """`rows`, each but bf16's with its speed-up over the bf16 row of its projection and token count."""
    bf16 = {(r["projection"], r["tokens"]): r["step_ms"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        if r["format"] != "bf16":
            r["speedup_vs_bf16"] = bf16[r["projection"], r["tokens"]] / r["step_ms"]
    return rows


def row(name: str, fmt: str, tokens: int, seconds: float, read: int, flops: int, hbm: float | None,
        flops_peak: float | None) -> dict:
    return {"projection": name, "format": fmt, "tokens": tokens, "step_ms": seconds * 1e3, "bytes": read,
            "flops": flops, "mbu": read / seconds / hbm if hbm else None,
            "mfu": flops / seconds / flops_peak if flops_peak else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dense = [name for name, shape in SHAPES.items() if not ModelConfig.from_hf(shape).num_experts]
    p.add_argument("--shape", default="qwen3-8b", choices=dense, help="a dense shape of engine/shapes.py")
    p.add_argument("--tiny", action="store_true", help="tiny projections on the CPU, under Triton's interpreter")
    p.add_argument("--scales", choices=("block", "row"), default="block",
                   help="one scale per 128 x 128 block (32 x 128 with --tiny), or one a row")
    p.add_argument("--multiprocessors", type=int,
                   help="split decode tiles over K for this many multiprocessors (default: the GPU's; none on a CPU)")
    add_run_args(p, TOKENS, TINY_TOKENS)
    args = p.parse_args(argv)
    device, dtype = run_device(p, args)
    shape, name = (TINY, "tiny Qwen3 layer") if args.tiny else (SHAPES[args.shape], args.shape)
    block = fp8.ROWS if args.scales == "row" else TINY_BLOCK if args.tiny else BLOCK
    if device.type == "cuda" and not fp8.projections_kept(torch.cuda.get_device_capability(device)):
        p.error("this GPU's Triton reads no float8 e4m3 (sm_89 and later do): the engine dequantizes FP8 here")
    tokens = token_counts(args, TOKENS, TINY_TOKENS)
    device_name, hbm, flops_peak = device_peaks(device, args)
    result = {"device": device_name, "shape": name, "scales": args.scales, "block": list(block),
              "dtype": str(dtype).removeprefix("torch."), "hbm_peak_bytes_per_s": hbm, "bf16_peak_flops": flops_peak,
              "rows": measure(ModelConfig.from_hf(shape), tokens, args.iters, device, dtype, block, hbm, flops_peak,
                              args.multiprocessors)}
    return emit(args, result, print_table)


def print_table(result: dict) -> None:
    block = result["block"]
    scales = "one scale a row" if tuple(block) == fp8.ROWS else f"{block[0]}x{block[1]} blocks"
    print(f"Device: {result['device']}; {result['shape']}'s projections, FP8 with {scales}, "
          f"activations {result['dtype']}")
    print_markdown(["tokens:", "projection", "weights", "path", "splits over K:", "ms:",
                    "speed-up vs bf16:", "MBU:", "MFU:", "max rel. diff vs bf16 of its codes:"],
                   [[r["tokens"], r["projection"], r["format"], r.get("path", "-"), r.get("splits") or "-",
                     f"{r['step_ms']:.3f}", ratio(r.get("speedup_vs_bf16")), pct(r["mbu"]), pct(r["mfu"]),
                     sci(r.get("max_rel_diff"))]
                    for r in result["rows"]])


if __name__ == "__main__":
    sys.exit(main())
