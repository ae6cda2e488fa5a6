"""A W8A16 GEMM in Triton for the dense projections of an FP8 checkpoint on CUDA: out = x @ W.T
where W is the checkpoint's float8 e4m3 codes [N, K] times their blocks' (or rows', `fp8.ROWS`) scales,
read as stored (a byte a weight, half of bf16's: what a memory-bound decode step reads) and
widened tile by tile to the activations' dtype for the tensor cores (`triton_tiles.weight_tile`,
each code times its block's scale rounded as `fp8.dequantize` rounds it). Products accumulate in
float32, rounded once. Nothing waits on the host and the launch depends only on the token count,
so a decode step through it is captured in a CUDA graph like any other.

The torch oracle is `fp8.dequantize` then `F.linear` (what the CPU path runs); on CPU the kernel
runs only under Triton's interpreter (how the tests check it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine import fp8
from splitserve.engine.model.triton_tiles import input_tile, weight_tile

# (most tokens, BLOCK_M, BLOCK_N, warps): decode batches take thin 16-row tiles and 32 columns (more
# programs, so every SM streams weights), prefills square 128 tiles that reuse each weight tile
TILES = ((16, 16, 32, 4), (64, 64, 64, 4), (None, 128, 128, 8))


@triton.jit(do_not_specialize=["tokens"])
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, tokens, n, k, stride_x, stride_w, stride_s, stride_out,
                       block_rows, block_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    """One program per (BLOCK_M tokens, BLOCK_N outputs): out = x @ (codes * scales).T over k in
    BLOCK_K steps, each within one block of columns (block_cols a multiple of BLOCK_K)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        a = input_tile(x_ptr, rows, stride_x, start, k, valid, BLOCK_K)
        w = weight_tile(w_ptr, s_ptr, cols, start, k, stride_w, stride_s, block_rows, block_cols, col_ok, a.dtype,
                        BLOCK_K, True)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def tile_for(tokens: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of a launch over `tokens` rows."""
    return next(tuple(tile) for most, *tile in TILES if most is None or tokens <= most)


def tile_examples() -> list[int]:
    """A token count of each tile shape (the most it takes; past the last bound, one more)."""
    return [most or TILES[-2][0] + 1 for most, *_ in TILES]


def block_k_for(block: tuple[int, int]) -> int:
    """The k tile: 64 where a block's columns hold whole 64s (128 in Qwen's and DeepSeek's releases)."""
    return 64 if block[1] % 64 == 0 else fp8.KERNEL_K


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ W.T for W = `weight` (float8 e4m3 [N, K]) times `scale` (float32, one per block
    of `block` [rows, cols], the last blocks partial); [..., N] in x's dtype."""
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
    if tokens:
        block_m, block_n, warps = tile_for(tokens)
        _fp8_matmul_kernel[(triton.cdiv(tokens, block_m), triton.cdiv(n, block_n))](
            rows, weight, scale, out, tokens, n, k, rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            block[0], block[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k_for(block),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)
    return out.view(*x.shape[:-1], n)
