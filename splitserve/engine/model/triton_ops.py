"""Triton kernels for the decoder's elementwise work on CUDA, where each separate torch op of a
small decode batch is a launch of its own: the residual add and RMSNorm in one pass, and the
rotary embedding of q and k in place. The torch code in `llama.RMSNorm` and `rotary` is the
oracle; on CPU these run only under Triton's interpreter (how the tests check them).

Rounding follows the oracle where it decides the result's dtype: the residual sum is rounded to
the activations' dtype before it is normalized, and the normalized row is rounded before it is
scaled by the weight (as Hugging Face's Llama does; Gemma's norm scales by 1 + weight and rounds
only the result). The rotation is computed in float32 and
rounded once, where the oracle rounds each product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, stride_x, stride_r, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: out = norm(x [+ residual]) * weight; the sum is stored to `summed`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        out = (1.0 + w) * h
    else:
        out = w * h.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) for [T, hidden] rows; without a residual,
    (norm(x) * weight, x), where x may have more leading dims (q's heads [T, heads, head_dim]).
    `gemma`: scaled by (1 + weight), in x's dtype."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]) if residual is None else x  # heads of a merged projection: a copy
    count, cols = rows.shape
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((count, cols), dtype=out_dtype, device=x.device)
    summed = torch.empty((count, cols), dtype=x.dtype, device=x.device) if residual is not None else x
    if count:
        _add_rms_norm_kernel[(count,)](
            rows, residual if residual is not None else rows, weight, out, summed, rows.stride(0),
            residual.stride(0) if residual is not None else 0, cols, eps,
            HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK=triton.next_power_of_2(cols))
    return out.view(shape), summed


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])  # a view into a step's inputs: any offset
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_table,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, head): the rotate-half rotation of that head at its position."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    cos = tl.load(cos_ptr + position * stride_table + i, mask=mask, other=0.0)  # both halves of a row are equal
    sin = tl.load(sin_ptr + position * stride_table + i, mask=mask, other=0.0)
    base = x_ptr + token * stride_t + head * stride_h
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + i, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotate_in_place(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x: [T, heads, head_dim] (head_dim contiguous) rotated at `positions` by float32 tables
    [max_len, head_dim] whose two halves are equal."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("rotary needs head_dim contiguous in x and in the tables")
    if tokens:
        _rotary_kernel[(tokens, heads)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                        HALF=head_dim // 2, BLOCK=triton.next_power_of_2(head_dim // 2))
