"""The W8A8 k loop the fused-MoE kernels share (`fused_moe`): a tile of gathered rows' e4m3 codes
(`fp8_w8a8.quantize`'s, one float32 scale a row and GROUP columns) times one or two tiles of a
weight's codes, each k step's dot scaled by both scales before it joins the float32 sums."""
from __future__ import annotations

import triton
import triton.language as tl

from splitserve.engine.model import fp8_w8a8
from splitserve.engine.model.triton_tiles import weight_scales

GROUP = tl.constexpr(fp8_w8a8.GROUP)  # activation columns a scale covers (a whole number of k tiles)


@triton.jit
def w8a8_dots(gate, up, a_ptr, rows, stride_a, valid, as_ptr, stride_as, w, s, gate_rows, up_rows, col_ok, k,
               stride_wn, stride_sn, block_rows, block_cols, gate_scale_row, up_scale_row, BLOCK_K: tl.constexpr,
               TWO: tl.constexpr, TILE_SCALES: tl.constexpr, EVEN_K: tl.constexpr):
    """W8A8 over k in BLOCK_K steps: gate (and with TWO, up) += dot(codes of a's rows `rows`, codes
    of w's rows `gate_rows` (`up_rows`)) * the rows' group scales (as_ptr [groups, stride_as]) * w's
    block scales: with TILE_SCALES one a k step for the whole tile (rows `gate_scale_row`,
    `up_scale_row` of the scales), else each row's. Rows not `valid` or not `col_ok` read row 0
    (any valid address: they are not stored); with EVEN_K, k is whole steps and loads take no masks."""
    kk = tl.arange(0, BLOCK_K)
    safe_rows = tl.where(valid, rows, 0)
    a_ptrs = a_ptr + safe_rows[:, None] * stride_a + kk[None, :]
    g_ptrs = w + tl.where(col_ok, gate_rows, 0)[None, :].to(tl.int64) * stride_wn + kk[:, None]
    u_ptrs = w + tl.where(col_ok, up_rows, 0)[None, :].to(tl.int64) * stride_wn + kk[:, None]
    as_ptrs = as_ptr + safe_rows
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(start + kk < k)[None, :], other=0.0)
        a_scale = tl.load(as_ptrs + (start // GROUP) * stride_as)
        gate += tl.dot(a, _codes(g_ptrs, start, k, kk, EVEN_K)) * _step_scales(
            a_scale, s, gate_rows, gate_scale_row, start, stride_sn, block_rows, block_cols, col_ok, TILE_SCALES)
        if TWO:
            up += tl.dot(a, _codes(u_ptrs, start, k, kk, EVEN_K)) * _step_scales(
                a_scale, s, up_rows, up_scale_row, start, stride_sn, block_rows, block_cols, col_ok, TILE_SCALES)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return gate, up


@triton.jit
def _codes(ptrs, start, k, kk, EVEN_K: tl.constexpr):
    """A [BLOCK_K, N] tile of weight codes at `ptrs` (columns past k read as 0 unless EVEN_K)."""
    if EVEN_K:
        codes = tl.load(ptrs)
    else:
        codes = tl.load(ptrs, mask=(start + kk < k)[:, None], other=0.0)
    return codes


@triton.jit
def _step_scales(a_scale, s, rows, scale_row, start, stride_sn, block_rows, block_cols, col_ok,
                 TILE_SCALES: tl.constexpr):
    """[M, 1] or [M, N]: what a W8A8 k step's dot is scaled by, a's group scales times w's block scales."""
    if TILE_SCALES:  # one return: the branches' shapes differ ([M, 1], [M, N]), as compiled Triton allows only so
        scales = (a_scale * tl.load(s + scale_row * stride_sn + start // block_cols))[:, None]
    else:
        scales = a_scale[:, None] * weight_scales(s, rows, start, stride_sn, block_rows, block_cols, col_ok)[None, :]
    return scales
