"""The Triton attention kernels alone, on one layer of a shape (Llama-3-8B's by default): a prompt of
N tokens prefilled over the paged cache with each prefill configuration (query rows x keys a tile,
warps, software pipelining stages; one whose buffers do not fit a block's shared memory is
reported as such), against torch's scaled_dot_product_attention on the same queries, keys and
values laid out contiguously (flash attention on CUDA: the bar a paged kernel aims at) and the
FlashAttention-2 varlen kernel the engine runs fresh prompts with where torch has it
(`torch_flash`, kernel "torch-flash"); and B
sequences of C tokens decoded over a cache of the serving dtype and over an FP8 cache (e4m3
codes, half the bytes), at each count of pipelining stages, against the bytes their keys and
values take. A configuration costs a compile and milliseconds here, not an engine's start: tune
the prefill tiles and the decode's stages with it. Each row is printed as it is measured (a JSON
line), so a run cut short keeps the rows before.

    python scripts/bench_attention.py --json attn.json     # CUDA: seconds a configuration
    python scripts/bench_attention.py --tiny               # a tiny layer on the CPU (Triton's interpreter)

FLOPs of a causal prefill: 4 x N(N + 1)/2 x heads x head_dim (QK^T and PV over the keys at or before
each query); bytes of a decode: B x C x 2 x kv_heads x head_dim x the element size, what the kernel
must read. Each row is the median of --iters calls after one untimed call (CUDA events on a GPU),
and says how far the kernel's output is from SDPA's on the same keys (a check of the compiled
kernel; over an FP8 cache, SDPA reads the values its codes stand for).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from bench_moe import (  # this script's folder
    add_run_args, device_peaks, emit, pct, print_markdown, ratio, run_device, sci, time_calls, token_counts,
)

from splitserve.engine.attention import fp8_kv, torch_flash
from splitserve.engine.attention.base import Scoring
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.config import ModelConfig
from splitserve.engine.shapes import SHAPES

BLOCK_SIZE = 16  # the engine's default KV block
FP8_SCALES = (0.02, 0.01)  # K's and V's, so the standard normal keys and values use most of e4m3's codes
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16}
PREFILLS, TINY_PREFILLS = (2048, 8192), (64, 100)
DECODES, TINY_DECODES = "1x4096,64x4096,256x1024", "3x80"
# Triton's default (a key tile copied one iteration ahead: the engine's over a bf16 cache) and two
# ahead (the engine's over an FP8 cache)
DECODE_STAGES = "3,5"
# the engine's sm_80 and sm_90 tiles at Triton's default 3 stages and at the engine's 5 (key tiles
# copied two ahead), deeper, and longer key tiles (3 stages: 5 would not fit 227 KiB of shared memory)
CONFIGS = "64x64x8x3,64x64x8x5,128x64x8x3,128x64x8x5,128x64x8x7,128x128x8x3"
TINY_CONFIGS = "16x16x4x3,32x16x4x5"


def _meta(contexts: list[int], queries: list[int], num_decodes: int, device: torch.device) -> AttentionMetadata:
    """Sequences laid out one after another in the cache (each its own whole blocks), the first
    `num_decodes` of them decodes."""
    width, tables, start = max(-(-c // BLOCK_SIZE) for c in contexts), [], 0
    for context in contexts:
        blocks = -(-context // BLOCK_SIZE)
        tables.append(list(range(start, start + blocks)) + [0] * (width - blocks))
        start += blocks
    starts = [0]
    for n in queries:
        starts.append(starts[-1] + n)
    return AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), torch.tensor(tables, device=device),
                             torch.tensor(contexts, device=device), starts, contexts, num_decodes,
                             query_start_tensor=torch.tensor(starts, device=device))


def prefill_rows(shape: dict, lengths: list[int], configs: list[tuple[int, int, int, int]], iters: int,
                 device: torch.device, dtype: torch.dtype, flops_peak: float | None) -> list[dict]:
    from splitserve.engine.attention.triton_paged import TritonPagedBackend  # once --tiny set TRITON_INTERPRET

    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    cuda, rows = device.type == "cuda", []
    for n in lengths:
        q = torch.randn(n, heads, dim, device=device, dtype=dtype)
        k, v = (torch.randn(n, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
        cache = torch.empty(2, -(-n // BLOCK_SIZE), BLOCK_SIZE, kv_heads, dim, device=device, dtype=dtype)
        cache[0].view(-1, kv_heads, dim)[:n], cache[1].view(-1, kv_heads, dim)[:n] = k, v
        meta, flops = _meta([n], [n], 0, device), 4 * n * (n + 1) // 2 * heads * dim
        contiguous = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, heads, n, dim]
        reference = F.scaled_dot_product_attention(*contiguous, is_causal=True, enable_gqa=True)
        sdpa = time_calls(lambda: F.scaled_dot_product_attention(*contiguous, is_causal=True, enable_gqa=True),
                          iters, cuda)
        _keep(rows, _prefill_row("sdpa", n, None, sdpa, flops, flops_peak, sdpa))
        if torch_flash.runs_on(device) and torch_flash.takes(q, Scoring()):  # the engine's kernel for fresh prompts
            cu = torch.tensor([0, n], dtype=torch.int32, device=device)
            flash = time_calls(lambda: torch_flash.attend(q, k, v, cu, n, Scoring(), None), iters, cuda)
            diff = (torch_flash.attend(q, k, v, cu, n, Scoring(), None).transpose(0, 1)[None].float()
                    - reference.float()).abs().max().item()
            _keep(rows, {**_prefill_row("torch-flash", n, None, flash, flops, flops_peak, sdpa),
                         "max_abs_diff_vs_sdpa": diff})
        for block_m, block_n, warps, stages in configs:
            backend = TritonPagedBackend(block_m, block_n, prefill_warps=warps, prefill_stages=stages)
            out = torch.empty_like(q)
            try:
                seconds = time_calls(lambda: backend.prefill(q, cache, meta, out), iters, cuda)
            except OutOfResources as error:  # Triton checks a variant's shared memory when it launches
                _keep(rows, {**_prefill_row("triton", n, (block_m, block_n, warps, stages)), "error": str(error)})
                continue
            diff = (out.transpose(0, 1)[None].float() - reference.float()).abs().max().item()
            row = _prefill_row("triton", n, (block_m, block_n, warps, stages), seconds, flops, flops_peak, sdpa)
            _keep(rows, {**row, "max_abs_diff_vs_sdpa": diff})
    return rows


def _keep(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def _prefill_row(kernel: str, n: int, config: tuple[int, int, int, int] | None, seconds: float | None = None,
                 flops: int = 0, flops_peak: float | None = None, sdpa_seconds: float = 0.0) -> dict:
    """A prefill's row; without `seconds` (a configuration that did not run), its times are None."""
    tiles, warps, stages = (None, None, None) if config is None else (f"{config[0]}x{config[1]}", *config[2:])
    row = {"kind": "prefill", "kernel": kernel, "tokens": n, "tiles": tiles, "warps": warps, "stages": stages,
           "ms": None, "tflops": None, "mfu": None, "speedup_vs_sdpa": None}
    if seconds is not None:
        row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                   mfu=flops / seconds / flops_peak if flops_peak else None, speedup_vs_sdpa=sdpa_seconds / seconds)
    return row


def decode_rows(shape: dict, decodes: list[tuple[int, int]], stages: list[int], iters: int, device: torch.device,
                dtype: torch.dtype, hbm: float | None) -> list[dict]:
    from splitserve.engine.attention.triton_paged import TritonPagedBackend

    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    rows = []
    for (batch, context), fp8, count in ((d, fp8, n) for d in decodes for fp8 in (False, True) for n in stages):
        backend = TritonPagedBackend(decode_stages=count)
        meta = _meta([context] * batch, [1] * batch, batch, device)
        values = torch.randn(2, batch * -(-context // BLOCK_SIZE), BLOCK_SIZE, kv_heads, dim, device=device,
                             dtype=dtype)
        cache, scales = values, (1.0, 1.0)
        if fp8:
            cache, scales = torch.stack([fp8_kv.quantize(values[i], FP8_SCALES[i]) for i in (0, 1)]), FP8_SCALES
            values = torch.stack([fp8_kv.dequantize(cache[i], FP8_SCALES[i], dtype) for i in (0, 1)])
        q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
        out = torch.empty_like(q)
        seconds = time_calls(lambda: backend.decode(q, cache, meta, out, kv_scale=scales), iters, device.type == "cuda")
        keys, vals = (values[i].view(batch, -1, kv_heads, dim)[:, :context].transpose(1, 2) for i in (0, 1))
        reference = F.scaled_dot_product_attention(q[:, :, None], keys, vals, enable_gqa=True)[:, :, 0]
        read = batch * context * 2 * kv_heads * dim * cache.element_size()
        _keep(rows, {"kind": "decode", "kernel": "triton", "kv_cache": "fp8" if fp8 else "auto", "batch": batch,
                     "context": context, "stages": count, "ms": seconds * 1e3, "bytes": read,
                     "gb_per_s": read / seconds / 1e9, "mbu": read / seconds / hbm if hbm else None,
                     "max_abs_diff_vs_sdpa": (out.float() - reference.float()).abs().max().item()})
    return rows


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; {result['shape']}: {result['heads']} heads, {result['kv_heads']} KV heads, "
          f"head_dim {result['head_dim']}, {result['dtype']}, KV blocks of {BLOCK_SIZE}")
    print_markdown(["kind", "kernel", "tiles, warps, stages", "tokens / batch x context", "ms:", "TFLOP/s or GB/s:",
                    "MFU or MBU:", "vs SDPA:", "max abs diff vs SDPA:"], [_cells(r) for r in result["rows"]])


def _cells(r: dict) -> list:
    diff = sci(r.get("max_abs_diff_vs_sdpa"))
    if r["kind"] == "decode":
        return ["decode" + (", FP8 KV" if r["kv_cache"] == "fp8" else ""), r["kernel"], f"-, -, {r['stages']}",
                f"{r['batch']} x {r['context']}", f"{r['ms']:.3f}", f"{r['gb_per_s']:.0f}", pct(r["mbu"]), "-", diff]
    tiles = "-" if r["tiles"] is None else f"{r['tiles']}, {r['warps']}, {r['stages']}"
    if r["ms"] is None:
        return ["prefill", r["kernel"], tiles, r["tokens"], "does not fit", "-", "-", "-", "-"]
    return ["prefill", r["kernel"], tiles, r["tokens"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", pct(r["mfu"]),
            ratio(r["speedup_vs_sdpa"]), diff]


def _items(text: str, parts: int) -> list[tuple[int, ...]]:
    """"AxB,CxD" -> [(A, B), (C, D)]; ValueError unless every item is `parts` positive integers."""
    items = [tuple(int(x) for x in item.split("x")) for item in text.split(",")]
    if any(len(item) != parts or min(item) < 1 for item in items):
        raise ValueError(text)
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="a shape of engine/shapes.py")
    p.add_argument("--tiny", action="store_true", help="a tiny layer on the CPU, under Triton's interpreter")
    p.add_argument("--configs", help=f"prefill configurations, ROWSxKEYSxWARPSxSTAGES, comma-separated "
                                      f"(default {CONFIGS})")
    p.add_argument("--decodes", help=f"decode batches, BATCHxCONTEXT, comma-separated (default {DECODES})")
    p.add_argument("--decode-stages", default=DECODE_STAGES, help=f"the decode's pipelining stages, comma-separated "
                                                                 f"(default {DECODE_STAGES})")
    add_run_args(p, PREFILLS, TINY_PREFILLS)
    args = p.parse_args(argv)
    device, dtype = run_device(p, args)
    if args.tiny:
        shape, name = TINY, "tiny layer"
    else:
        c, name = ModelConfig.from_hf(SHAPES[args.shape]), args.shape
        shape = {"heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim}
    try:
        configs = _items(args.configs or (TINY_CONFIGS if args.tiny else CONFIGS), 4)
        decodes = _items(args.decodes or (TINY_DECODES if args.tiny else DECODES), 2)
        stages = [n for (n,) in _items(args.decode_stages, 1)]
    except ValueError as error:
        p.error(f"--configs takes ROWSxKEYSxWARPSxSTAGES items, --decodes BATCHxCONTEXT items and --decode-stages "
                f"positive integers, comma-separated; got {error}")
    lengths = token_counts(args, PREFILLS, TINY_PREFILLS)
    device_name, hbm, flops_peak = device_peaks(device, args)
    rows = prefill_rows(shape, lengths, configs, args.iters, device, dtype, flops_peak)
    rows += decode_rows(shape, decodes, stages, args.iters, device, dtype, hbm)
    result = {"device": device_name, "shape": name, **shape, "dtype": str(dtype).removeprefix("torch."),
              "hbm_peak_bytes_per_s": hbm, "bf16_peak_flops": flops_peak, "rows": rows}
    return emit(args, result, print_table)


if __name__ == "__main__":
    sys.exit(main())
