"""A W8A16 GEMM in Triton for the dense projections of an FP8 checkpoint on CUDA: out = x @ W.T
where W is the checkpoint's float8 e4m3 codes [N, K] times their blocks' (or rows', `fp8.ROWS`) scales,
read as stored (a byte a weight, half of bf16's: what a memory-bound decode step reads) and
widened tile by tile to the activations' dtype for the tensor cores (`triton_tiles.weight_tile`,
each code times its block's scale rounded as `fp8.dequantize` rounds it). Products accumulate in
float32, rounded once. A decode batch's launch also splits over K (`split_k`). Nothing waits on
the host and the launch depends only on the token count, so a decode step through it is captured
in a CUDA graph like any other. From `PREFILL_TOKENS` tokens a product is bound by the tensor cores, not by reading
the codes, and widening every code again in each 128-row tile (beside the tensor cores) would cost
more than one pass over them. On a GPU with FP8 tensor cores the activations are then quantized
and the codes multiplied as they are (`fp8_w8a8`, twice bf16's rate); elsewhere (or where a block
splits a group of columns) the weight is dequantized once into the activations' dtype and cuBLAS
multiplies. Either allocates a transient (the activations' codes, or the weight's copy) that the
engine's memory profile sees at its largest step; a CUDA graph's capture keeps the tiled kernel,
since the graph's pool would hold a transient for good.

The torch oracle is `fp8.dequantize` then `F.linear` (what the CPU path runs); on CPU the kernel
runs only under Triton's interpreter (how the tests check it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine import fp8
from splitserve.engine.model import fp8_w8a8, split_k
from splitserve.engine.model.split_k import store_sums
from splitserve.engine.model.triton_tiles import input_tile, weight_tile

# (most tokens, BLOCK_M, BLOCK_N, warps, splits over K): decode batches take tiles 128 columns wide
# (each program's fixed cost spread over more codes; the split keeps every SM streaming weights),
# prefills square 128 tiles that reuse each weight tile (docs/results/kernels-compiled.md)
TILES = ((16, 16, 128, 4, True), (64, 64, 128, 4, True), (None, 128, 128, 8, False))
# from this many tokens a product runs W8A8, or dequantizes the weight once for cuBLAS: by the H200's figures (75%
# MFU for cuBLAS bf16, the tiled GEMM at about half of it in prefills) the extra pass over the weight (a byte read,
# two written) costs less than the tiled GEMM's widening from about 512 tokens on
PREFILL_TOKENS = 512
PATHS = ("tiled", "dequantized", "w8a8")  # the W8A16 GEMM; the weight dequantized, then cuBLAS; `fp8_w8a8`
DEQUANTIZE_ROWS = 64  # weight rows a dequantizing program widens, over one k tile


@triton.jit(do_not_specialize=["tokens"])
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, count_ptr, tokens, n, k, k_split, stride_x,
                       stride_w, stride_s, stride_out, block_rows, block_cols, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (BLOCK_M tokens, BLOCK_N outputs, split): out = x @ (codes * scales).T over
    its split's `k_split` columns of k (a multiple of BLOCK_K) in BLOCK_K steps, each within one
    block of columns (block_cols a multiple of BLOCK_K). With SPLIT, `partial_ptr` holds float32
    [splits, tokens, n] and `count_ptr` one zeroed counter a tile."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    first = tl.program_id(2) * k_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(first, tl.minimum(k, first + k_split), BLOCK_K):
        a = input_tile(x_ptr, rows, stride_x, start, k, valid, BLOCK_K)
        w = weight_tile(w_ptr, s_ptr, cols, start, k, stride_w, stride_s, block_rows, block_cols, col_ok, a.dtype,
                        BLOCK_K, True)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_sums(acc, out_ptr, partial_ptr, count_ptr, rows, cols, valid[:, None] & col_ok[None, :], tokens, n,
               stride_out, SPLIT)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, n, k, stride_w, stride_s, stride_out, stride_we, stride_se, stride_oe,
                       block_rows, block_cols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (BLOCK_N rows, k tile within one block of columns, weight of a stack):
    out = codes times their block's scale, rounded once to out's dtype."""
    stacked = tl.program_id(2).to(tl.int64)
    w_ptr += stacked * stride_we
    s_ptr += stacked * stride_se
    out_ptr += stacked * stride_oe
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    start = tl.program_id(1) * BLOCK_K
    tile = weight_tile(w_ptr, s_ptr, rows, start, k, stride_w, stride_s, block_rows, block_cols, row_ok,
                       out_ptr.dtype.element_ty, BLOCK_K, True)  # [BLOCK_K, BLOCK_N]
    cols = start + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None], tile,
             mask=(cols < k)[:, None] & row_ok[None, :])


def tile_for(tokens: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, warps, splits over K) of a launch over `tokens` rows."""
    return next(tuple(tile) for most, *tile in TILES if most is None or tokens <= most)


def tile_examples(max_tokens: int | None = None) -> list[int]:
    """A token count of each launch shape of steps of at most `max_tokens` (None: any): of each tile
    (the most it takes; past the last bound, one more), and the first of prefills' path where a
    step reaches it (the warm-up's transient is then one the memory profile's largest step made too)."""
    tiles = [most or TILES[-2][0] + 1 for most, *_ in TILES]
    return tiles + ([PREFILL_TOKENS] if max_tokens is None or max_tokens >= PREFILL_TOKENS else [])


def block_k_for(block: tuple[int, int]) -> int:
    """The k tile: 64 where a block's columns hold whole 64s (128 in Qwen's and DeepSeek's releases)."""
    return 64 if block[1] % 64 == 0 else fp8.KERNEL_K


def split_plan(tokens: int, n: int, k: int, block: tuple[int, int], sms: int | None,
               splits: int | None = None) -> tuple[int, int]:
    """(splits, the k columns each reads) of a launch over `tokens` rows of an [n, k] weight on `sms`
    multiprocessors (`splits` as `matmul` takes it): whole k tiles a split, none empty. Whether a
    shape splits depends on its tile, not on how many of the tile's rows are tokens, so each tile
    of a shape is one variant (compiled at start-up)."""
    block_m, block_n, _, splittable = tile_for(tokens)
    tiles = triton.cdiv(tokens, block_m) * triton.cdiv(n, block_n)
    return split_k.plan(tiles, k, block_m, block_k_for(block), sms, splittable, 1.0, splits)


def capturing(x: torch.Tensor) -> bool:
    """Whether `x`'s stream is capturing a CUDA graph, whose pool would hold a transient (a dequantized
    weight, quantized activations) for good."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """What `fp8.dequantize` computes ([N, K] in `dtype`; of a stack's codes [E, N, K] and scales
    [E, ...], each weight's), in one pass over the codes on their device."""
    *stack, n, k = weight.shape
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    block_k = block_k_for(block)
    strides = [t.stride(0) if stack else 0 for t in (weight, scale, out)]
    _dequantize_kernel[(triton.cdiv(n, DEQUANTIZE_ROWS), triton.cdiv(k, block_k), *stack)](
        weight, scale, out, n, k, weight.stride(-2), scale.stride(-2), out.stride(-2), *strides, block[0], block[1],
        BLOCK_N=DEQUANTIZE_ROWS, BLOCK_K=block_k)
    return out


def path_for(tokens: int, x: torch.Tensor, block: tuple[int, int]) -> str:
    """Which of `PATHS` a product of `tokens` rows like `x` takes: from `PREFILL_TOKENS`, W8A8 where the
    device has FP8 tensor cores and `block` whole groups of columns, else the weight dequantized;
    below it, or in a CUDA graph's capture, the tiled GEMM."""
    if tokens < PREFILL_TOKENS or capturing(x):
        return "tiled"
    return "w8a8" if fp8_w8a8.supported(x.device, block) else "dequantized"


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           splits: int | None = None, path: str | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for W = `weight` (float8 e4m3 [N, K]) times `scale` (float32, one per block
    of `block` [rows, cols], the last blocks partial); [..., N] in x's dtype. `splits`: a decode
    tile's splits over K (None: `split_k.split_count` for the device; the prefill tile never splits).
    `path`: one of `PATHS` (None: `path_for` the launch)."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("an FP8 linear needs float8_e4m3fn codes and float32 scales, rows contiguous")
    if block[1] % fp8.KERNEL_K:
        raise ValueError(f"an FP8 linear's blocks must be whole {fp8.KERNEL_K}-column k tiles, got {block}")
    if x.shape[-1] != k:
        raise ValueError(f"an FP8 linear of {k} input features got inputs of shape {tuple(x.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    tokens = rows.shape[0]
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    path = path or path_for(tokens, x, block)
    if path not in PATHS:
        raise ValueError(f"an FP8 linear's path must be one of {', '.join(PATHS)}, got {path!r}")
    if tokens and path == "w8a8":
        fp8_w8a8.matmul(rows, weight, scale, block, out)
    elif tokens and path == "dequantized":
        torch.mm(rows, dequantize(weight, scale, block, x.dtype).t(), out=out)
    elif tokens:
        block_m, block_n, warps, _ = tile_for(tokens)
        block_k = block_k_for(block)
        grid = (triton.cdiv(tokens, block_m), triton.cdiv(n, block_n))
        splits, k_split = split_plan(tokens, n, k, block, split_k.multiprocessors(x.device), splits)
        _fp8_matmul_kernel[(*grid, splits)](
            rows, weight, scale, out, split_k.partials(splits, tokens, n, out), split_k.counters(x.device), tokens, n,
            k, k_split, rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0), block[0], block[1],
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            SPLIT=splits > 1, num_warps=warps)
    return out.view(*x.shape[:-1], n)
