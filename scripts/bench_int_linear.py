"""One decoder layer's projections (QKV, o_proj, gate-up, down) of a dense model shape, in bf16
through torch's matmul (cuBLAS) and as packed integers (W4A16 by default, group 128 with zero
points, as llm-compressor's releases store them; `--bits 8`, `--group 0`: one scale a row) through
the integer GEMM (`int_linear.matmul`, as the CUDA engine runs a packed checkpoint's) side by side:
time at decode and prefill token counts, what each reads per second against the HBM peak (MBU), its
FLOPs against the dense bf16 peak (MFU), and each output's largest difference from its own weights
dequantized through cuBLAS (a check of the compiled kernel on the device). Every token count also
runs the path the GEMM does not take there ("int tiled", "int dequantized"): where one overtakes
the other, for `int_linear.PREFILL_TOKENS`. The GEMM splits a decode tile over K (for the device's
multiprocessors, or --multiprocessors); where some projection's launch splits, every projection
also runs unsplit ("int unsplit"): what the split gains.

    python scripts/bench_int_linear.py --json int-linear.json    # CUDA: Qwen3-8B's layer
    python scripts/bench_int_linear.py --shape llama3-8b         # another dense shape of engine/shapes.py
    python scripts/bench_int_linear.py --tiny                    # tiny projections on the CPU (Triton's interpreter)

Bytes read = the weight (bf16: 2 a value; packed: bits / 8 a value, its scales and zero points) +
the input and output rows; FLOPs = 2 x tokens x inputs x outputs. Each row is the median of --iters
calls after a warm-up (CUDA events on a GPU); a `layer` row sums the four projections.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench_fp8_linear import (  # this script's folder
    TINY, TINY_TOKENS, TOKENS, layer_rows, projections, row, with_speedups,
)
from bench_moe import (
    INT_SCHEME, add_run_args, device_peaks, emit, packed_weight, pct, print_markdown, ratio, run_device, sci,
    time_calls, token_counts,
)

from splitserve.engine.config import ModelConfig
from splitserve.engine.int_weights import IntWeights, dequantize
from splitserve.engine.shapes import SHAPES

GROUP = INT_SCHEME.group_size  # llm-compressor's W4A16 group


def measure(c: ModelConfig, tokens: list[int], iters: int, device: torch.device, dtype: torch.dtype,
            scheme: IntWeights, hbm: float | None, flops_peak: float | None, sms: int | None = None) -> list[dict]:
    """Rows of each projection and of the layer; `sms`: the multiprocessors decode tiles split for
    (None: the device's)."""
    from splitserve.engine.model import int_linear, split_k  # after TRITON_INTERPRET is settled

    sms = sms or split_k.multiprocessors(device)

    g, weights = torch.Generator().manual_seed(0), {}
    for name, shape in projections(c).items():
        packed, scale, zero = packed_weight(shape, scheme, device, g)
        parts = {"packed": packed, "scale": scale, "shape": torch.tensor(shape)}
        if zero is not None:
            parts["zero_point"] = zero
        weights[name] = (packed, scale, zero, dequantize(parts, scheme, dtype))
    rows, cuda = [], device.type == "cuda"
    for t in tokens:
        layer = {}  # format: [seconds, bytes, flops]
        plans = {name: int_linear.split_plan(t, *w[3].shape, scheme.bits, sms)[0] for name, w in weights.items()}
        for name, (packed, scale, zero, dense) in weights.items():
            x = torch.randn(t, dense.shape[1], generator=g).to(device, dtype)
            taken, splits = int_linear.path_for(t, x), plans[name]
            calls = {"bf16": (lambda: F.linear(x, dense), None),
                     "int": (lambda: int_linear.matmul(x, packed, scale, zero, scheme, splits=splits), taken)}
            if max(plans.values()) > 1:
                calls["int unsplit"] = (lambda: int_linear.matmul(x, packed, scale, zero, scheme, "tiled", 1), "tiled")
            for path in int_linear.PATHS:
                if path != taken:
                    calls[f"int {path}"] = (lambda path=path: int_linear.matmul(x, packed, scale, zero, scheme, path,
                                                                                splits), path)
            stored = packed.nbytes + scale.nbytes + (0 if zero is None else zero.nbytes)
            flops = 2 * t * dense.shape[0] * dense.shape[1]
            exact = F.linear(x, dense).float()
            for fmt, (call, path) in calls.items():
                seconds = time_calls(call, iters, cuda)
                read = (dense.nbytes if fmt == "bf16" else stored) + x.nbytes + t * dense.shape[0] * x.element_size()
                rows.append(row(name, fmt, t, seconds, read, flops, hbm, flops_peak))
                layer[fmt] = [a + b for a, b in zip(layer.get(fmt, [0.0, 0, 0]), (seconds, read, flops))]
                if path is not None:
                    rows[-1]["path"] = path
                    rows[-1]["splits"] = None if path != "tiled" else 1 if fmt == "int unsplit" else splits
                    rows[-1]["max_rel_diff"] = ((call().float() - exact).abs().max() / exact.abs().max()).item()
        rows += layer_rows(layer, t, hbm, flops_peak)
    return with_speedups(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dense = [name for name, shape in SHAPES.items() if not ModelConfig.from_hf(shape).num_experts]
    p.add_argument("--shape", default="qwen3-8b", choices=dense, help="a dense shape of engine/shapes.py")
    p.add_argument("--tiny", action="store_true", help="tiny projections on the CPU, under Triton's interpreter")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group", type=int, default=GROUP, help="columns a scale covers (0: one scale a row)")
    p.add_argument("--symmetric", action="store_true", help="no zero points")
    p.add_argument("--multiprocessors", type=int,
                   help="split decode tiles over K for this many multiprocessors (default: the GPU's; none on a CPU)")
    add_run_args(p, TOKENS, TINY_TOKENS)
    args = p.parse_args(argv)
    if args.group < 0:
        p.error(f"--group must be 0 (a row) or more, got {args.group}")
    device, dtype = run_device(p, args)
    shape, name = (TINY, "tiny Qwen3 layer") if args.tiny else (SHAPES[args.shape], args.shape)
    scheme = IntWeights(args.bits, args.group or None, args.symmetric)
    device_name, hbm, flops_peak = device_peaks(device, args)
    result = {"device": device_name, "shape": name, "bits": scheme.bits, "group": scheme.group_size,
              "symmetric": scheme.symmetric, "dtype": str(dtype).removeprefix("torch."),
              "hbm_peak_bytes_per_s": hbm, "bf16_peak_flops": flops_peak,
              "rows": measure(ModelConfig.from_hf(shape), token_counts(args, TOKENS, TINY_TOKENS), args.iters,
                              device, dtype, scheme, hbm, flops_peak, args.multiprocessors)}
    return emit(args, result, print_table)


def print_table(result: dict) -> None:
    group = f"groups of {result['group']}" if result["group"] else "one scale a row"
    zero = "symmetric" if result["symmetric"] else "zero points"
    print(f"Device: {result['device']}; {result['shape']}'s projections, {result['bits']}-bit weights in {group} "
          f"({zero}), activations {result['dtype']}")
    print_markdown(["tokens:", "projection", "weights", "path", "splits over K:", "ms:", "speed-up vs bf16:", "MBU:",
                    "MFU:", "max rel. diff vs bf16 of its weights:"],
                   [[r["tokens"], r["projection"], r["format"], r.get("path", "-"), r.get("splits") or "-",
                     f"{r['step_ms']:.3f}",
                     ratio(r.get("speedup_vs_bf16")), pct(r["mbu"]), pct(r["mfu"]), sci(r.get("max_rel_diff"))]
                    for r in result["rows"]])


if __name__ == "__main__":
    sys.exit(main())
