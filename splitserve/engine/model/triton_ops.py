"""Triton kernels for the decoder's elementwise work on CUDA, where each separate torch op of a
small decode batch is a launch of its own: the residual add and RMSNorm in one pass, the rotary
embedding of q and k in place in one launch (with Qwen3's per-head q and k norms before it), and
an MLP's gated activation, act(gate) * up, in one pass over the gate-up projection's output. The
torch code in `llama.RMSNorm`, `rotary` and `llama.LlamaMLP` is the oracle; on CPU these run only
under Triton's interpreter (how the tests check them; `triton_dispatch` says where they run).

Rounding follows the oracle where it decides the result's dtype: the residual sum is rounded to
the activations' dtype before it is normalized, and the normalized row is rounded before it is
scaled by the weight (as Hugging Face's Llama does; Gemma's norm scales by 1 + weight and rounds
only the result); the activation is rounded before it multiplies up, and the product once. The
rotation is computed in float32 and rounded once, where the oracle rounds each product.
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
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, stride_qt, stride_qh,
                   stride_kt, stride_kh, q_heads, stride_table, eps, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   NORM: tl.constexpr, GEMMA: tl.constexpr, INTERLEAVED: tl.constexpr, PARTNER: tl.constexpr):
    """One program per (token, head of q then of k): the rotation of that head at its position,
    turning each pair (dim i, dim i + HALF), or (2i, 2i + 1) where INTERLEAVED; NORM, the head
    RMS-normalized by q's or k's weight first."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    first = 2 * i if INTERLEAVED else i  # a pair's first dim; its second is PARTNER (1 or HALF) dims on
    cos = tl.load(cos_ptr + position * stride_table + first, mask=mask, other=0.0)  # equal at both dims of a pair
    sin = tl.load(sin_ptr + position * stride_table + first, mask=mask, other=0.0)
    if head < q_heads:
        base, weight_ptr = q_ptr + token * stride_qt + head * stride_qh, q_weight_ptr
    else:
        base, weight_ptr = k_ptr + token * stride_kt + (head - q_heads) * stride_kh, k_weight_ptr
    x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + PARTNER + first, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _normed_pairs(x1, x2, weight_ptr, first, PARTNER, mask, eps, q_ptr.dtype.element_ty, HALF, GEMMA)
    tl.store(base + first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(base + PARTNER + first, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed_pairs(x1, x2, weight_ptr, first, PARTNER: tl.constexpr, mask, eps, dtype: tl.constexpr,
                  HALF: tl.constexpr, GEMMA: tl.constexpr):
    """A head's pairs' two dims (float32, at `first` and PARTNER on) RMS-normalized over the whole
    head and scaled by its weight, rounded to `dtype` as `_add_rms_norm_kernel` rounds them."""
    inverse = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
    w1 = tl.load(weight_ptr + first, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + PARTNER + first, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        x1, x2 = (1.0 + w1) * (x1 * inverse), (1.0 + w2) * (x2 * inverse)
    else:
        x1, x2 = w1 * (x1 * inverse).to(dtype).to(tl.float32), w2 * (x2 * inverse).to(dtype).to(tl.float32)
    return x1.to(dtype).to(tl.float32), x2.to(dtype).to(tl.float32)


def rotate_in_place(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
                    interleaved: bool = False) -> None:
    """q [T, heads, dims] and k [T, kv_heads, dims] (dims contiguous, as many in both) rotated at
    `positions` by float32 tables [max_len, dims] whose two halves are equal, in one launch; or,
    `interleaved` (GLM-4's, Cohere's), pairs of neighbouring dims by tables equal at each pair.
    `norms`: (q's weight, k's weight, eps, gemma) of per-head RMS norms each head takes first, as
    `add_rms_norm` computes them (the rotation then covers whole heads; weights in q's dtype)."""
    tokens, heads, dims = q.shape
    if k.shape[0] != tokens or k.shape[2] != dims or k.dtype != q.dtype:
        raise ValueError(f"rotary needs q and k of the same tokens, dims and dtype, got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(k.shape)} {k.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("rotary needs the rotated dims contiguous in q, k and the tables")
    q_weight, k_weight, eps, gemma = norms or (cos, cos, 0.0, False)  # without norms the weights are never read
    if norms is not None and any(w.shape != (dims,) or w.dtype != q.dtype for w in (q_weight, k_weight)):
        raise ValueError(f"the heads' norms need a weight of {dims} values in {q.dtype} each")
    if tokens:
        _rotary_kernel[(tokens, heads + k.shape[1])](
            q, k, positions, cos, sin, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads,
            cos.stride(0), eps, HALF=dims // 2, BLOCK=triton.next_power_of_2(dims // 2), NORM=norms is not None,
            GEMMA=gemma, INTERLEAVED=interleaved, PARTNER=1 if interleaved else dims // 2)


GATED_BLOCK = 1024  # the most columns a program of `gated` takes


@triton.jit
def _gated_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, width, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, BLOCK columns): act(gate) rounded to the dtype, times up, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    # exp only of -|.|, which cannot overflow: sigmoid(g) = 1 / (1 + e) or e / (1 + e), e = exp(-|g|), and
    # tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
    if GELU:  # the tanh approximation
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(y))
        tanh = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(y < 0, -tanh, tanh))
    else:
        e = tl.exp(-tl.abs(gate))
        act = gate * tl.where(gate < 0, e, 1.0) / (1.0 + e)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated(gate: torch.Tensor, up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up (`gelu`: gelu(gate, approximate="tanh") * up) for gate and up [T, width]
    (columns contiguous: a merged projection's views), as a new [T, width] tensor."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"gate and up must be [T, width] of one dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("the gated activation needs gate's and up's columns contiguous")
    tokens, width = gate.shape
    out = torch.empty((tokens, width), dtype=gate.dtype, device=gate.device)
    block = min(GATED_BLOCK, triton.next_power_of_2(width))
    if tokens:
        _gated_kernel[(tokens, triton.cdiv(width, block))](gate, up, out, gate.stride(0), up.stride(0), width,
                                                          GELU=gelu, BLOCK=block)
    return out
