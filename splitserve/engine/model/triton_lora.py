"""LoRA adapters by row: each token row of a step runs under the adapter slot a device tensor
names (or none, -1), in two launches per projection whatever the adapters, and with no host sync,
so a decode step with adapters can be captured in a CUDA graph (punica's BGMV, in two kernels).

`shrink`: xa[t] = A[slot_t] x[t] (float32, [T, parts * rank]); `expand`: out[t, n] += xa[t, part of
n's rows] . B[slot_t, n] (n's part by the merged projection's row splits). A row reads its slot's
A and B whole: cheap for a decode's rows, costly for a prefill's (whose rows the torch path groups
by adapter, `model.lora`). The torch path by row (`model.lora.add_rows_torch`) is their oracle.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

SHRINK_BLOCK_R, SHRINK_BLOCK_K = 16, 128
EXPAND_TILE = 4096  # elements of B a program reads: BLOCK_N rows of BLOCK_RANK


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # a view into a graph's inputs: any offset
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, xa_ptr, K, R, stride_xt, stride_as, stride_ar, stride_xat,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (row, BLOCK_R of A's rows): xa[t, r] = sum_k A[slot, r, k] x[t, k]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        ak = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                     mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(ak * xk[None, :], axis=1)
    tl.store(xa_ptr + t * stride_xat + r, acc, mask=r < R)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _expand_kernel(xa_ptr, b_ptr, slots_ptr, out_ptr, N, RANK, split1, split2, stride_xat, stride_bs, stride_bn,
                   stride_ot, BLOCK_N: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """One program per (row, BLOCK_N of the output): out[t, n] += sum_j xa[t, part(n) * RANK + j] B[slot, n, j],
    part(n) = (n >= split1) + (n >= split2)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_RANK)
    part = (n >= split1).to(tl.int32) + (n >= split2).to(tl.int32)
    mask = (n[:, None] < N) & (j[None, :] < RANK)
    xa = tl.load(xa_ptr + t * stride_xat + part[:, None] * RANK + j[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + j[None, :], mask=mask, other=0.0)
    delta = tl.sum(xa * b.to(tl.float32), axis=1)
    rows = out_ptr + t * stride_ot + n
    kept = tl.load(rows, mask=n < N, other=0.0).to(tl.float32)
    tl.store(rows, (kept + delta).to(out_ptr.dtype.element_ty), mask=n < N)


def add_rows(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
             part_rows: Sequence[int]) -> torch.Tensor:
    """`out` [T, N] += each row's adapter product, in place: x [T, K], A [slots, parts * rank, K],
    B [slots, N, rank] (contiguous), `row_slots` [T] (-1: none), `part_rows` the parts' sizes (<= 3)."""
    rows, (k, rank), r = x.shape[0], (x.shape[1], b.shape[-1]), a.shape[1]
    if not rows:
        return out
    xa = torch.empty((rows, r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, triton.cdiv(r, SHRINK_BLOCK_R))](
        x, a, row_slots, xa, k, r, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        BLOCK_R=SHRINK_BLOCK_R, BLOCK_K=SHRINK_BLOCK_K)
    n = out.shape[1]
    split1, split2 = part_rows[0], part_rows[0] + part_rows[1] if len(part_rows) > 2 else n
    block_rank = triton.next_power_of_2(rank)
    block_n = max(16, EXPAND_TILE // block_rank)
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        xa, b, row_slots, out, n, rank, split1, split2, xa.stride(0),
        b.stride(0), b.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_RANK=block_rank)
    return out

