"""Tile loads the Triton GEMMs share (the fused MoE kernels, the FP8 and integer linears): a tile
of the activations' rows, and a tile of a weight's rows as a dot's right operand, FP8 codes times
their block's scale (a k tile lies within one block of columns) rounded to the activations' dtype,
as `fp8.dequantize` rounds them, or the codes as stored and their scales apart (W8A8), or packed
integers widened to (value - zero point) x scale (`int_weights`)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def input_tile(a_ptr, rows, stride_row, start, limit, valid, BLOCK_K: tl.constexpr):
    """[M, BLOCK_K]: rows `rows` of a's columns [start, start + BLOCK_K), zeros past `limit` and
    where not `valid`."""
    k = start + tl.arange(0, BLOCK_K)
    return tl.load(a_ptr + rows[:, None] * stride_row + k[None, :], mask=valid[:, None] & (k < limit)[None, :],
                   other=0.0)


@triton.jit
def weight_tile(w, scales, rows, start, limit, stride_row, stride_scale_row, block_rows, block_cols, row_ok,
                dtype: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_K, N]: weight rows `rows`' columns [start, start + BLOCK_K) as a dot's right operand
    (zeros past `limit`); with FP8 each code times its block's scale (the K within one block of
    columns), in `dtype`."""
    k = start + tl.arange(0, BLOCK_K)
    tile = tl.load(w + rows[None, :] * stride_row + k[:, None], mask=(k < limit)[:, None] & row_ok[None, :], other=0.0)
    if FP8:
        scale = weight_scales(scales, rows, start, stride_scale_row, block_rows, block_cols, row_ok)
        tile = (tile.to(tl.float32) * scale[None, :]).to(dtype)
    return tile


@triton.jit
def weight_scales(scales, rows, start, stride_scale_row, block_rows, block_cols, row_ok):
    """[N]: the scale of each of weight rows `rows` at column `start` (its block's; 0 where not `row_ok`)."""
    return tl.load(scales + (rows // block_rows) * stride_scale_row + start // block_cols, mask=row_ok, other=0.0)


@triton.jit
def int_weight_tile(w_ptr, s_ptr, z_ptr, cols, start, k, stride_w, stride_s, stride_z, group, col_ok,
                    dtype: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, ONE_GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """[BLOCK_K, N]: weight rows `cols`' columns [start, start + BLOCK_K) as a dot's right operand,
    each (value - zero point) x scale in `dtype` (zeros past `k`)."""
    per_word: tl.constexpr = 32 // BITS
    mask: tl.constexpr = (1 << BITS) - 1
    offset: tl.constexpr = 1 << (BITS - 1)
    kk = start + tl.arange(0, BLOCK_K)
    ok = (kk < k)[:, None] & col_ok[None, :]
    words = tl.load(w_ptr + cols[None, :] * stride_w + (kk // per_word)[:, None], mask=ok, other=0)
    values = (((words >> ((kk % per_word) * BITS)[:, None]) & mask) - offset).to(tl.float32)
    if ONE_GROUP:  # the tile lies in one group: a scale (and zero point) a column
        g = start // group
        scale = tl.load(s_ptr + cols * stride_s + g, mask=col_ok, other=0.0)[None, :]
        if ZERO:
            zeros = tl.load(z_ptr + (cols // per_word) * stride_z + g, mask=col_ok, other=0)
            values -= (((zeros >> ((cols % per_word) * BITS)) & mask) - offset).to(tl.float32)[None, :]
    else:
        g = kk // group
        scale = tl.load(s_ptr + cols[None, :] * stride_s + g[:, None], mask=ok, other=0.0)
        if ZERO:
            zeros = tl.load(z_ptr + (cols // per_word)[None, :] * stride_z + g[:, None], mask=ok, other=0)
            values -= (((zeros >> ((cols % per_word) * BITS)[None, :]) & mask) - offset).to(tl.float32)
    return (values * scale).to(dtype)
