"""A W4A16 / W8A16 GEMM in Triton for the dense projections of a packed integer checkpoint on CUDA
(`int_weights`): out = x @ W.T where W is read as stored, int32 words of 32 / bits values of a row
(a quarter of bf16's bytes at 4 bits: what a memory-bound decode step reads), each value widened
in the tile to (value - its zero point) x its group's scale in the activations' dtype for the
tensor cores. Products accumulate in float32, rounded once. A k tile within one group (the group a
multiple of the tile, or a scale a row) loads one scale (and zero point) a column; otherwise one an
element. A decode batch's launch also splits over K (`split_k`: a split reads at least four times
its float32 sums' bytes in words). From `PREFILL_TOKENS` tokens a product is bound by the tensor
cores, and the weight is dequantized once into the activations' dtype for cuBLAS (a transient the
engine's memory profile sees at its largest step; a CUDA graph's capture keeps the tiled kernel,
whose pool would hold it).
The launch depends only on the token count: a decode step through it is captured in a CUDA graph.

The torch oracle is `int_weights.dequantize` then `F.linear` (what the CPU path runs); on CPU the
kernel runs only under Triton's interpreter (how the tests check it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.int_weights import IntWeights
from splitserve.engine.model import split_k
from splitserve.engine.model.fp8_linear import capturing
from splitserve.engine.model.split_k import store_sums
from splitserve.engine.model.triton_tiles import input_tile, int_weight_tile

# (most tokens, BLOCK_M, BLOCK_N, warps, splits over K): decode batches split over K (every SM streaming words), the
# 16-row tile 128 columns wide (compiled for sm_90, 11% fewer instructions a KB of words than 64 wide; 64 rows that
# wide spill on sm_80); prefills under a CUDA graph's capture square tiles (docs/results/kernels-compiled.md)
TILES = ((16, 16, 128, 4, True), (64, 64, 64, 4, True), (None, 128, 128, 8, False))
BLOCK_K = 64  # a multiple of every packing's values a word (8 at 4 bits, 4 at 8)
PREFILL_TOKENS = 512  # from here the weight is dequantized once and cuBLAS multiplies (fp8_linear's reasoning)
PATHS = ("tiled", "dequantized")
DEQUANTIZE_ROWS = 64  # weight rows a dequantizing program widens, over one k tile


@triton.jit(do_not_specialize=["tokens"])
def _int_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partial_ptr, count_ptr, tokens, n, k, k_split, stride_x,
                       stride_w, stride_s, stride_z, stride_out, group, BITS: tl.constexpr, ZERO: tl.constexpr,
                       ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (BLOCK_M tokens, BLOCK_N outputs, split): out = x @ W.T over its split's
    `k_split` columns of k (a multiple of BLOCK_K) in BLOCK_K steps; with SPLIT the splits' sums
    meet as `split_k.store_sums` says."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    first = tl.program_id(2) * k_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(first, tl.minimum(k, first + k_split), BLOCK_K):
        a = input_tile(x_ptr, rows, stride_x, start, k, valid, BLOCK_K)
        w = int_weight_tile(w_ptr, s_ptr, z_ptr, cols, start, k, stride_w, stride_s, stride_z, group, col_ok,
                            a.dtype, BITS, ZERO, ONE_GROUP, BLOCK_K)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_sums(acc, out_ptr, partial_ptr, count_ptr, rows, cols, valid[:, None] & col_ok[None, :], tokens, n,
               stride_out, SPLIT)


@triton.jit
def _int_dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, n, k, stride_w, stride_s, stride_z, stride_out,
                           stride_we, stride_se, stride_ze, stride_oe, group, BITS: tl.constexpr, ZERO: tl.constexpr,
                           ONE_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [n, k] in its dtype: W's rows [BLOCK_N] over one k tile a program, of the weight
    `program_id(2)` of a stack (each part `stride_*e` after the one before)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    start = tl.program_id(1) * BLOCK_K
    e = tl.program_id(2).to(tl.int64)
    tile = int_weight_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_ze, rows, start, k,
                           stride_w, stride_s, stride_z, group, row_ok, out_ptr.dtype.element_ty, BITS, ZERO,
                           ONE_GROUP, BLOCK_K)  # [BLOCK_K, BLOCK_N]
    cols = start + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e * stride_oe + rows[None, :].to(tl.int64) * stride_out + cols[:, None], tile,
             mask=(cols < k)[:, None] & row_ok[None, :])


def tile_for(tokens: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, warps, splits over K) of a launch over `tokens` rows."""
    return next(tuple(tile) for most, *tile in TILES if most is None or tokens <= most)


def tile_examples(max_tokens: int | None = None) -> list[int]:
    """A token count of each launch shape of steps of at most `max_tokens` (None: any): each tile's
    most, one past the last bound, and the first of prefills' path where a step reaches it."""
    tiles = [most or TILES[-2][0] + 1 for most, *_ in TILES]
    return tiles + ([PREFILL_TOKENS] if max_tokens is None or max_tokens >= PREFILL_TOKENS else [])


def _launch_args(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: IntWeights, k: int):
    """What the kernels take of the weight: its pointers, their row strides, the columns a scale
    covers, and the constants."""
    group = scheme.group_size or k
    zeros = packed if zero is None else zero  # any pointer where there are no zero points
    return ((packed, scale, zeros), (packed.stride(-2), scale.stride(-2), zeros.stride(-2)), group,
            dict(BITS=scheme.bits, ZERO=zero is not None, ONE_GROUP=group % BLOCK_K == 0 or group >= k))


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: IntWeights, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """What `int_weights.dequantize` computes ([N, K] in `dtype`), in one pass on the words' device;
    of a stack of weights (parts [E, ...]: a sparse layer's experts), each one's ([E, N, K]), in one launch."""
    stacked = packed.dim() == 3
    experts, n = (packed.shape[0] if stacked else 1), packed.shape[-2]
    out = torch.empty((experts, n, k), dtype=dtype, device=packed.device)
    pointers, strides, group, constants = _launch_args(packed, scale, zero, scheme, k)
    expert_strides = [t.stride(0) if stacked else 0 for t in pointers]
    _int_dequantize_kernel[(triton.cdiv(n, DEQUANTIZE_ROWS), triton.cdiv(k, BLOCK_K), experts)](
        *pointers, out, n, k, *strides, out.stride(1), *expert_strides, out.stride(0), group, **constants,
        BLOCK_N=DEQUANTIZE_ROWS, BLOCK_K=BLOCK_K)
    return out if stacked else out[0]


def split_plan(tokens: int, n: int, k: int, bits: int, sms: int | None,
               splits: int | None = None) -> tuple[int, int]:
    """(splits, the k columns each reads) of a launch over `tokens` rows of an [n, k] weight of
    `bits`-bit values on `sms` multiprocessors (`splits` as `matmul` takes it): one variant a tile."""
    block_m, block_n, _, splittable = tile_for(tokens)
    tiles = triton.cdiv(tokens, block_m) * triton.cdiv(n, block_n)
    return split_k.plan(tiles, k, block_m, BLOCK_K, sms, splittable, bits / 8, splits)


def path_for(tokens: int, x: torch.Tensor) -> str:
    """From `PREFILL_TOKENS` (outside a CUDA graph's capture) the weight dequantized; else tiled."""
    return "dequantized" if tokens >= PREFILL_TOKENS and not capturing(x) else "tiled"


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
           scheme: IntWeights, path: str | None = None, splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for W packed as `int_weights` describes (`packed` int32 [N, ceil(K x bits /
    32)], `scale` [N, groups], `zero` packed zero points or None): [..., N] in x's dtype. `path`: one
    of `PATHS` (None: `path_for` the launch). `splits`: a decode tile's splits over K (None:
    `split_k.split_count` for the device; the prefill tile never splits)."""
    n, k = packed.shape[0], x.shape[-1]
    if packed.dtype != torch.int32 or packed.shape[1] != -(-k * scheme.bits // 32) or packed.stride(1) != 1:
        raise ValueError(f"an integer linear of {k} input features needs int32 words [N, "
                         f"{-(-k * scheme.bits // 32)}], rows contiguous; got {packed.dtype} {tuple(packed.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    tokens = rows.shape[0]
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    path = path or path_for(tokens, x)
    if path not in PATHS:
        raise ValueError(f"an integer linear's path must be one of {', '.join(PATHS)}, got {path!r}")
    if tokens and path == "dequantized":
        torch.mm(rows, dequantize(packed, scale, zero, scheme, k, x.dtype).t(), out=out)
    elif tokens:
        block_m, block_n, warps, _ = tile_for(tokens)
        splits, k_split = split_plan(tokens, n, k, scheme.bits, split_k.multiprocessors(x.device), splits)
        pointers, strides, group, constants = _launch_args(packed, scale, zero, scheme, k)
        _int_matmul_kernel[(triton.cdiv(tokens, block_m), triton.cdiv(n, block_n), splits)](
            rows, *pointers, out, split_k.partials(splits, tokens, n, out), split_k.counters(x.device), tokens, n, k,
            k_split, rows.stride(0), *strides, out.stride(0), group, **constants, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=BLOCK_K, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
            num_warps=warps)
    return out.view(*x.shape[:-1], n)
