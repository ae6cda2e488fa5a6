"""The fused-MoE layer's two Triton kernels, which `fused_moe.fused_experts` launches (its docstring
says what they compute and how they read each format): gate and up with the gated activation over
a tile of one expert's assignments, then down times the routing weight."""
from __future__ import annotations

import triton
import triton.language as tl

from splitserve.engine.model.expert_dequantize import e2m1
from splitserve.engine.model.triton_tiles import input_tile, int_weight_tile, weight_tile
from splitserve.engine.model.w8a8_tiles import w8a8_dots


@triton.jit
def _group_inputs(a_ptr, rows, stride_row, group, valid):
    """Rows `rows` of a's 32-value group `group`: its even and odd columns, each [M, 16] (zeros
    where not `valid`), which a packed byte's low and high nibbles multiply."""
    at = a_ptr + rows[:, None] * stride_row + group * 32 + 2 * tl.arange(0, 16)[None, :]
    return tl.load(at, mask=valid[:, None], other=0.0), tl.load(at + 1, mask=valid[:, None], other=0.0)


@triton.jit
def _mxfp4_group(acc, a_even, a_odd, blocks, scales, rows, group, stride_row, stride_scale_row, row_ok,
                 PRECISION: tl.constexpr):
    """acc + a @ W[rows, group].T over one 32-value group of MXFP4 rows `rows` (byte j holds values
    2j, low nibble, and 2j + 1): a_even, a_odd [M, 16] are a's even and odd columns of the group."""
    j = tl.arange(0, 16)
    codes = tl.load(blocks + rows[None, :] * stride_row + group * 16 + j[:, None], mask=row_ok[None, :],
                    other=0).to(tl.int32)
    exponent = tl.load(scales + rows * stride_scale_row + group, mask=row_ok, other=0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)[None, :]  # 2 ** (e - 127); e = 0 reads as 0
    acc = tl.dot(a_even, (e2m1(codes & 15) * scale).to(a_even.dtype), acc, input_precision=PRECISION)
    return tl.dot(a_odd, (e2m1(codes >> 4) * scale).to(a_odd.dtype), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_assignments", "first_expert", "num_experts", "stride_as"])
def gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_assignments, top_k,
                    hidden, width, stride_x, stride_we, stride_wn, stride_se, stride_sn, block_rows, block_cols,
                    stride_ze, stride_zn, group, stride_be, row_step, up_offset, alpha, limit, stride_out,
                    first_expert, num_experts, as_ptr, stride_as, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, BIAS: tl.constexpr, OSS: tl.constexpr,
                    CLAMP: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr, W8A8: tl.constexpr,
                    TILE_SCALES: tl.constexpr, EVEN_K: tl.constexpr, INT_BITS: tl.constexpr, ZERO: tl.constexpr,
                    ONE_GROUP: tl.constexpr):
    """One program per (tile of one expert's assignments, BLOCK_N of the width), for the tiles of
    experts [first_expert, first_expert + num_experts), whose weights w13 (and scales) stack:
    out[a] = act(x[token] @ gate.T, x[token] @ up.T) for each assignment a of the tile. Gate column
    c is w13's row c * row_step, up's that plus up_offset (1, width: halves; 2, 1: interleaved);
    with BIAS the same entries of b13 are added. act: `_gated`. PACKED: w13 is MXFP4 bytes (rows of hidden / 2) and s_ptr its scales (rows of hidden / 32);
    FP8: w13 is float8 codes and s_ptr the scales of its blocks of block_rows x block_cols. W8A8:
    so are w13 and x (`fp8_w8a8.quantize`'s codes, as_ptr its scales [groups, stride_as]), multiplied
    as codes, each k step's dot scaled by the tokens' group scales and the rows' block scales
    (`w8a8_tiles.w8a8_dots`; TILE_SCALES: one block of rows holds the tile's gate rows, and one its up rows).
    INT_BITS (4 or 8; 0: not integers): w13 is packed words, s_ptr its scales, one a `group` of
    columns, and with ZERO z_ptr its zero points packed down the rows (`triton_tiles.int_weight_tile`)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if (expert < first_expert) | (expert >= first_expert + num_experts):  # another launch's, or past the last group
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_assignments  # the padding holds num_assignments
    tokens = (rows // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    w = w_ptr + (expert - first_expert).to(tl.int64) * stride_we
    gate_rows, up_rows = cols * row_step, cols * row_step + up_offset
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = s_ptr + (expert - first_expert).to(tl.int64) * stride_se  # the expert's scales (PACKED, FP8, INT_BITS)
    z = z_ptr + (expert - first_expert).to(tl.int64) * stride_ze  # its zero points (INT_BITS with ZERO)
    if PACKED:  # hidden is whole groups
        for group in range(0, hidden // 32):
            a_even, a_odd = _group_inputs(x_ptr, tokens, stride_x, group, valid)
            gate = _mxfp4_group(gate, a_even, a_odd, w, s, gate_rows, group, stride_wn, stride_sn, col_ok, PRECISION)
            up = _mxfp4_group(up, a_even, a_odd, w, s, up_rows, group, stride_wn, stride_sn, col_ok, PRECISION)
    elif W8A8:
        first_row = tl.program_id(1) * BLOCK_N * row_step
        gate, up = w8a8_dots(gate, up, x_ptr, tokens, stride_x, valid, as_ptr, stride_as, w, s, gate_rows, up_rows,
                              col_ok, hidden, stride_wn, stride_sn, block_rows, block_cols, first_row // block_rows,
                              (first_row + up_offset) // block_rows, BLOCK_K, True, TILE_SCALES, EVEN_K)
    elif INT_BITS:
        for start in range(0, hidden, BLOCK_K):
            a = input_tile(x_ptr, tokens, stride_x, start, hidden, valid, BLOCK_K)
            g = int_weight_tile(w, s, z, gate_rows, start, hidden, stride_wn, stride_sn, stride_zn, group, col_ok,
                                a.dtype, INT_BITS, ZERO, ONE_GROUP, BLOCK_K)
            u = int_weight_tile(w, s, z, up_rows, start, hidden, stride_wn, stride_sn, stride_zn, group, col_ok,
                                a.dtype, INT_BITS, ZERO, ONE_GROUP, BLOCK_K)
            gate = tl.dot(a, g, gate, input_precision=PRECISION)
            up = tl.dot(a, u, up, input_precision=PRECISION)
    else:
        for start in range(0, hidden, BLOCK_K):
            a = input_tile(x_ptr, tokens, stride_x, start, hidden, valid, BLOCK_K)
            g = weight_tile(w, s, gate_rows, start, hidden, stride_wn, stride_sn, block_rows, block_cols, col_ok,
                            a.dtype, BLOCK_K, FP8)
            u = weight_tile(w, s, up_rows, start, hidden, stride_wn, stride_sn, block_rows, block_cols, col_ok,
                            a.dtype, BLOCK_K, FP8)
            gate = tl.dot(a, g, gate, input_precision=PRECISION)
            up = tl.dot(a, u, up, input_precision=PRECISION)
    if BIAS:
        b = b_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(b + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = _gated(gate, up, alpha, limit, OSS, CLAMP)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _gated(gate, up, alpha, limit, OSS: tl.constexpr, CLAMP: tl.constexpr):
    """silu(gate) * up, or with OSS (up + 1) * gate * sigmoid(alpha * gate), with CLAMP gate <= limit
    and |up| <= limit first. An exponential past float32's range is inf, and x / inf is 0: no NaN."""
    if OSS:
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    return act


@triton.jit(do_not_specialize=["num_assignments", "first_expert", "num_experts", "stride_as"])
def down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
                 num_assignments, width, hidden, stride_act, stride_we, stride_wn, stride_se, stride_sn, block_rows,
                 block_cols, stride_ze, stride_zn, group, stride_be, stride_out, first_expert, num_experts, as_ptr,
                 stride_as, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, BIAS: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr,
                 W8A8: tl.constexpr, TILE_SCALES: tl.constexpr, EVEN_K: tl.constexpr, INT_BITS: tl.constexpr,
                 ZERO: tl.constexpr, ONE_GROUP: tl.constexpr):
    """One program per (tile of one expert's assignments, BLOCK_N of hidden), experts as in
    `gate_up_kernel`: out[a] = weight[a] * (act[a] @ down.T + b2[expert] with BIAS); PACKED, FP8,
    W8A8 and INT_BITS as there, over the width."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if (expert < first_expert) | (expert >= first_expert + num_experts):
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_assignments
    at = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w_ptr + (expert - first_expert).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = s_ptr + (expert - first_expert).to(tl.int64) * stride_se
    z = z_ptr + (expert - first_expert).to(tl.int64) * stride_ze
    if PACKED:  # the width is whole groups
        for group in range(0, width // 32):
            a_even, a_odd = _group_inputs(act_ptr, at, stride_act, group, valid)
            acc = _mxfp4_group(acc, a_even, a_odd, w, s, cols, group, stride_wn, stride_sn, col_ok, PRECISION)
    elif W8A8:
        first_row = tl.program_id(1) * BLOCK_N
        acc, _ = w8a8_dots(acc, acc, act_ptr, at, stride_act, valid, as_ptr, stride_as, w, s, cols, cols, col_ok,
                            width, stride_wn, stride_sn, block_rows, block_cols, first_row // block_rows,
                            first_row // block_rows, BLOCK_K, False, TILE_SCALES, EVEN_K)
    elif INT_BITS:
        for start in range(0, width, BLOCK_K):
            a = input_tile(act_ptr, at, stride_act, start, width, valid, BLOCK_K)
            d = int_weight_tile(w, s, z, cols, start, width, stride_wn, stride_sn, stride_zn, group, col_ok, a.dtype,
                                INT_BITS, ZERO, ONE_GROUP, BLOCK_K)
            acc = tl.dot(a, d, acc, input_precision=PRECISION)
    else:
        for start in range(0, width, BLOCK_K):
            a = input_tile(act_ptr, at, stride_act, start, width, valid, BLOCK_K)
            d = weight_tile(w, s, cols, start, width, stride_wn, stride_sn, block_rows, block_cols, col_ok, a.dtype,
                            BLOCK_K, FP8)
            acc = tl.dot(a, d, acc, input_precision=PRECISION)
    if BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(weights_ptr + at, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + at[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])
