"""One sparse layer's experts through the fused-MoE kernels (`fused_moe.fused_experts`, as the CUDA
engine runs them), dense (bf16), as MXFP4 bytes, as FP8 codes and as packed integers (W4A16 in groups
of 128 with zero points, as llm-compressor's releases store them) side by side: the layer's time at
decode and prefill token counts, what it reads per second against the HBM peak (MBU) and its FLOPs
against the dense bf16 peak (MFU). The dense weights are the MXFP4 ones dequantized, the FP8 ones
those in 128 x 128 blocks, the integers random words; each quantized row also says how far its
output is from its own weights dequantized through the dense kernels (a check of the compiled
kernels on the device). Each quantized format runs every way at every token count: its codes read
by the kernels, its stack dequantized first (`fused_moe.dequantizes`) and, for FP8 where the GPU
has FP8 tensor cores (or on the CPU, interpreted), W8A8 (its difference also the activations'
e4m3 rounding, a few percent); a row's `path` says which, and `default` whether the engine takes it there.

    python scripts/bench_moe.py --json moe.json                 # CUDA: gpt-oss-20b's layer, seconds
    python scripts/bench_moe.py --shape qwen3-30b-a3b           # another MoE shape of engine/shapes.py
    python scripts/bench_moe.py --tiny                          # a tiny layer on the CPU (Triton's interpreter)

Tokens are routed by random router logits (a uniform choice of each token's top-k experts); bytes
read = the experts hit (their weights, scales and biases) + the layer's input and output rows; FLOPs
= 6 x tokens x top-k x hidden x width (gate, up and down). Each row is the median of --iters calls
after a warm-up (CUDA events on a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from gpu_roofline import peaks  # this script's folder

from splitserve.engine import fp8, int_weights, mxfp4
from splitserve.engine.config import ModelConfig
from splitserve.engine.int_weights import IntWeights
from splitserve.engine.model.moe import gated_act, route
from splitserve.engine.shapes import SHAPES

TINY = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 7.0}
TOKENS = (1, 16, 64, 256, 2048, 8192)
FORMATS = ("dense", "mxfp4", "fp8", "int")
FP8_BLOCK = (128, 128)  # Qwen3's and DeepSeek's FP8 releases' blocks
INT_SCHEME = IntWeights(4, 128, False)  # llm-compressor's W4A16
TINY_TOKENS = (1, 4, 32)


def layer(c: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """`c`'s sparse layer's experts per format, (w13, w2): random MXFP4 ones (uniform codes, scales
    near DUMMY_SCALE), the same dequantized to `dtype` (dense), those in FP8 blocks, and random
    packed integers (`packed_weight`); and GPT-OSS's gate-up and down biases (None for others)."""
    g = torch.Generator().manual_seed(seed)
    formats = {fmt: [] for fmt in FORMATS}
    for rows, cols in ((2 * c.moe_intermediate_size, c.hidden_size), (c.hidden_size, c.moe_intermediate_size)):
        groups = cols // mxfp4.GROUP
        blocks = torch.randint(0, 256, (c.num_experts, rows, groups, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(mxfp4.DUMMY_SCALE - 1, mxfp4.DUMMY_SCALE + 2, (c.num_experts, rows, groups),
                               dtype=torch.uint8, generator=g)
        packed = mxfp4.Packed(blocks.to(device), scales.to(device), dtype)
        dense = mxfp4.dequantize(packed.blocks, packed.scales, dtype)
        formats["mxfp4"].append(packed)
        formats["dense"].append(dense)
        formats["fp8"].append(fp8.Stacked(*fp8.quantize(dense, FP8_BLOCK), FP8_BLOCK, dtype))
        ints = packed_weight((c.num_experts, rows, cols), INT_SCHEME, device, g)
        formats["int"].append(int_weights.Stacked(*ints, INT_SCHEME, cols, dtype))
    biased = c.architecture == "GptOssForCausalLM"
    b13, b2 = ((torch.randn(c.num_experts, n, generator=g) * 0.02).to(device, dtype) if biased else None
               for n in (2 * c.moe_intermediate_size, c.hidden_size))
    return {**{name: tuple(stacks) for name, stacks in formats.items()}, "b13": b13, "b2": b2}


def packed_weight(shape: tuple[int, ...], scheme: IntWeights, device: torch.device, g: torch.Generator) -> tuple:
    """(words, scales, zero points or None) of a weight [..., rows, cols]: random words and zero
    points (every bit pattern is a valid pack), scales that make 4-bit weights about normal(0,
    0.02)'s spread."""
    *lead, n, k = shape
    groups = -(-k // (scheme.group_size or k))
    words = lambda rows, cols: torch.randint(-2**31, 2**31 - 1, (*lead, rows, cols), generator=g,  # noqa: E731
                                             dtype=torch.int64).to(torch.int32).to(device)
    packed = words(n, -(-k * scheme.bits // 32))
    scale = torch.full((*lead, n, groups), 0.02 / 2 ** (scheme.bits - 2), device=device)
    zero = None if scheme.symmetric else words(-(-n * scheme.bits // 32), groups)
    return packed, scale, zero


def weight_bytes(w13, w2, biases: tuple, experts: int) -> int:
    """Bytes of `experts` experts' weights (MXFP4: bytes and scales; FP8: codes and scales;
    integers: words, scales and zero points) and `biases` (None where absent)."""
    def tensors(w):
        if isinstance(w, int_weights.Stacked):
            return (w.packed, w.scale) + (() if w.zero is None else (w.zero,))
        return (w.blocks, w.scales) if isinstance(w, mxfp4.Packed) else (w.weight, w.scale) \
            if isinstance(w, fp8.Stacked) else (w,)

    total = sum(t.nbytes for w in (w13, w2) for t in tensors(w)) + sum(b.nbytes for b in biases if b is not None)
    return total * experts // w13.shape[0]


def time_calls(call, iters: int, cuda: bool) -> float:
    """Median seconds of a call, after one untimed (compiles)."""
    call()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def runnable(fmt: str, device: torch.device) -> list[str]:
    """The paths a quantized stack of `fmt` (FP8 ones in FP8_BLOCK) can take on `device`."""
    from splitserve.engine.model import fp8_w8a8, fused_moe  # after TRITON_INTERPRET is settled

    w8a8 = fmt == "fp8" and fp8_w8a8.runs_on(device, FP8_BLOCK)
    return [path for path in fused_moe.PATHS if path != "w8a8" or w8a8]


def measure(c: ModelConfig, tokens: list[int], iters: int, device: torch.device, dtype: torch.dtype,
            hbm: float | None, flops_peak: float | None) -> list[dict]:
    from splitserve.engine.model import fused_moe  # after TRITON_INTERPRET is settled

    stacks, act, rows = layer(c, device, dtype), gated_act(c), []
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    formats = [f for f in FORMATS if f != "fp8" or fp8.codes_readable(capability)]  # no e4m3 before sm_89
    b13, b2 = stacks["b13"], stacks["b2"]
    for t in tokens:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, c.hidden_size, generator=g).to(device, dtype)
        weights, experts = route(torch.randn(t, c.num_experts, generator=g).to(device), c.num_experts_per_tok,
                                 c.norm_topk_prob)
        hit = experts.unique().numel()
        dense_ms = None
        taken = {fmt: fused_moe.path_for(fmt, experts.numel(), c.num_experts, x, FP8_BLOCK) for fmt in formats}
        paths = [(fmt, path) for fmt in formats  # dense first; each quantized format's path, then the others
                 for path in (["as read"] if fmt == "dense" else
                              [taken[fmt]] + [p for p in runnable(fmt, device) if p != taken[fmt]])]
        for fmt, path in paths:
            w13, w2 = stacks[fmt]

            def call(w13=w13, w2=w2, path=path):
                return fused_moe.fused_experts(x, w13, w2, weights, experts, act=act, b13=b13,
                                               dequantize_first=path != "as read", w8a8=path == "w8a8", b2=b2)

            seconds = time_calls(call, iters, device.type == "cuda")
            read = weight_bytes(w13, w2, (b13, b2), hit) + 2 * x.nbytes
            flops = 6 * t * c.num_experts_per_tok * c.hidden_size * c.moe_intermediate_size
            row = {"format": fmt, "path": path, "default": path == taken[fmt], "tokens": t,
                   "experts_hit": hit, "step_ms": seconds * 1e3, "bytes": read, "flops": flops,
                   "mbu": read / seconds / hbm if hbm else None,
                   "mfu": flops / seconds / flops_peak if flops_peak else None}
            if dense_ms is None:
                dense_ms = row["step_ms"]
            else:  # against its own weights dequantized, through the dense kernels
                exact = call(*(torch.stack([w[e] for e in range(c.num_experts)]) for w in (w13, w2)), "as read").float()
                row["speedup_vs_dense"] = dense_ms / row["step_ms"]
                row["max_rel_diff"] = ((call().float() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()
            rows.append(row)
    return rows


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; {result['shape']}: {result['experts']} experts, top {result['top_k']}, "
          f"hidden {result['hidden']}, width {result['width']}, activations {result['dtype']}")
    print_markdown(["tokens:", "experts hit:", "weights", "path", "ms:", "speed-up vs dense:", "MBU:", "MFU:",
                    "max rel. diff vs its weights dequantized:"],
                   [[r["tokens"], r["experts_hit"], r["format"], r["path"] + ("" if r["default"] else " (not taken)"),
                     f"{r['step_ms']:.3f}",
                     ratio(r.get("speedup_vs_dense")), pct(r["mbu"]), pct(r["mfu"]), sci(r.get("max_rel_diff"))]
                    for r in result["rows"]])


def print_markdown(columns: list[str], rows: list[list]) -> None:
    """A markdown table; a column named with a trailing ':' is right-aligned (the ':' not shown)."""
    print("| " + " | ".join(c.removesuffix(":") for c in columns) + " |")
    print("|" + "|".join("---:" if c.endswith(":") else "---" for c in columns) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


def summary(values: list[float]) -> dict:
    """Repeated runs' figure: its median and range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_runs(runs: list[dict], by: str, groups: list, figures: tuple[str, ...]) -> list[dict]:
    """Per group (the runs whose `by` is it, in the order of `groups`): each figure's `summary`."""
    return [{by: group, **{key: summary([r[key] for r in runs if r[by] == group]) for key in figures}}
            for group in groups]


def spread(figure: dict, scale: float = 1.0, digits: int = 0) -> str:
    """A `summary`, times `scale`, as "median [min-max]"."""
    return (f"{figure['median'] * scale:.{digits}f} [{figure['min'] * scale:.{digits}f}-"
            f"{figure['max'] * scale:.{digits}f}]")


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def add_run_args(p: argparse.ArgumentParser, tokens: tuple[int, ...], tiny_tokens: tuple[int, ...]) -> None:
    """The options a kernel benchmark's run takes: token counts, timed calls, device peaks, output."""
    p.add_argument("--tokens", help=f"comma-separated token counts (default: {','.join(map(str, tokens))}; "
                                    f"--tiny: {','.join(map(str, tiny_tokens))})")
    p.add_argument("--iters", type=int, default=50, help="timed calls per row")
    p.add_argument("--hbm-tbs", type=float, help="HBM peak in TB/s (default: from the device's name)")
    p.add_argument("--bf16-tflops", type=float, help="dense bf16 peak in TFLOP/s (default: from the device's name)")
    p.add_argument("--json", type=Path, help="write the result here")


def run_device(p: argparse.ArgumentParser, args) -> tuple[torch.device, torch.dtype]:
    """--tiny: the CPU under Triton's interpreter, in float16 (the interpreter's tl.dot misreads
    bfloat16); else CUDA in bfloat16, or a usage error without it."""
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first decorated
        return torch.device("cpu"), torch.float16
    if not torch.cuda.is_available():
        p.error("no CUDA device: run with --tiny for the CPU version")
    return torch.device("cuda"), torch.bfloat16


def token_counts(args, tokens: tuple[int, ...], tiny_tokens: tuple[int, ...]) -> list[int]:
    return [int(n) for n in args.tokens.split(",")] if args.tokens else list(tiny_tokens if args.tiny else tokens)


def emit(args, result: dict, show) -> int:
    """The result written to --json where asked, then shown (`show(result)`); the exit status."""
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    show(result)
    return 0


def device_peaks(device: torch.device, args) -> tuple[str, float | None, float | None]:
    """(the device's name, its HBM peak, its dense bf16 peak): --hbm-tbs / --bf16-tflops, else its data sheet's."""
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return (name, *peaks(name, args.hbm_tbs, args.bf16_tflops))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    moe_shapes = [name for name, shape in SHAPES.items() if ModelConfig.from_hf(shape).num_experts]
    p.add_argument("--shape", default="gpt-oss-20b", choices=moe_shapes, help="an MoE shape of engine/shapes.py")
    p.add_argument("--tiny", action="store_true", help="a tiny layer on the CPU, under Triton's interpreter")
    add_run_args(p, TOKENS, TINY_TOKENS)
    args = p.parse_args(argv)
    device, dtype = run_device(p, args)
    shape, name = (TINY, "tiny GPT-OSS layer") if args.tiny else (SHAPES[args.shape], args.shape)
    tokens = token_counts(args, TOKENS, TINY_TOKENS)
    c = ModelConfig.from_hf(shape)
    device_name, hbm, flops_peak = device_peaks(device, args)
    result = {"device": device_name, "shape": name, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
              "hidden": c.hidden_size, "width": c.moe_intermediate_size, "dtype": str(dtype).removeprefix("torch."),
              "hbm_peak_bytes_per_s": hbm, "bf16_peak_flops": flops_peak,
              "rows": measure(c, tokens, args.iters, device, dtype, hbm, flops_peak)}
    return emit(args, result, print_table)


if __name__ == "__main__":
    sys.exit(main())
