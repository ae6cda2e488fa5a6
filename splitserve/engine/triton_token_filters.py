"""Top-k, top-p and min-p on CUDA without sorting the vocabulary and without a host sync
(`token_filters` is the torch path and this kernel's oracle).

One program per row finds the row's threshold, the least value it keeps, then drops what is
below it. A float32's bits, with every bit but the sign flipped on negatives (and -0.0 taken as
+0.0), are an int32 key in the floats' order, so the threshold is the key where a running total
from the top first reaches a target: the k-th largest key for top-k (counting every value), the
key where the mass, exp of the values at or above top-k's threshold, reaches top_p of their whole
mass for top-p. That key is found by a radix descent, four bits a pass over the row: each pass
sums the bucket's values by their next digit (16 bins) and keeps the bin where the total from the
top crosses the target, so eight passes leave one key. Counts are exact; masses are float sums,
so a top-p boundary can differ from the sorted cumulative sum's where the two round differently.
Min-p's threshold is a value: the row's maximum is 0 (rows come shifted), so it keeps values at
or above ln(min_p).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512           # values of a row binned at a time
DIGIT_BITS = 4        # a pass's digit: 16 bins
WARPS = 16            # a value a thread: with two (8 warps) ptxas spilled on sm_89


@triton.jit
def _key(x):
    """The int32 key of float32 values, in their order (-0.0 keyed as +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)


@triton.jit
def _descend(row_ptr, vocab, floor, goal, MASS: tl.constexpr, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The largest key t with total(keys >= t) >= target, over the row's keys >= floor: counts with
    target = goal, or (MASS) masses exp(value) with target = goal * their sum. Where rounding leaves
    no bin reaching it, the descent takes the lowest bin (keeps more). Digits are read from the
    keys with the sign bit flipped (unsigned order); a block with no key in the bucket (most, once
    the bucket is narrow) is not binned."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    bins = tl.arange(0, BINS)
    prefix = tl.full([], 0, tl.int32)  # the digits chosen so far, at their bits
    above = 0.0                        # the total of the keys above the bucket
    target = goal
    for p in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (p + 1)
        binned = tl.zeros([BLOCK, BINS], tl.float32)  # summed over its rows once a pass
        for start in range(0, vocab, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < vocab, other=float("-inf"))
            key = _key(x)
            ordered = key ^ (-2**31)
            member = (offsets < vocab) & (key >= floor)
            if p > 0:
                member = member & (((ordered ^ prefix) >> (shift + DIGIT_BITS)) == 0)
            if tl.max(member.to(tl.int32), axis=0) > 0:
                weight = tl.where(member, tl.exp(x) if MASS else 1.0, 0.0)
                digit = (ordered >> shift) & (BINS - 1)
                binned += tl.where(digit[:, None] == bins[None, :], weight[:, None], 0.0)
        sums = tl.sum(binned, axis=0)
        from_top = tl.cumsum(sums, axis=0, reverse=True)
        if MASS and p == 0:
            target = goal * tl.sum(sums, axis=0)
        chosen = tl.max(tl.where(above + from_top >= target, bins, 0), axis=0)
        above += tl.sum(tl.where(bins > chosen, sums, 0.0), axis=0)
        prefix = prefix | (chosen << shift)
    return prefix ^ (-2**31)


@triton.jit
def token_filter_kernel(x_ptr, top_k_ptr, top_p_ptr, min_logp_ptr, vocab, stride_row, BLOCK: tl.constexpr,
                        DIGIT_BITS: tl.constexpr):
    """Row r of x (its maximum 0) with the values below its threshold set to -inf, in place: top-k
    (top_k[r] in [1, vocab), else off), top-p over what top-k keeps (top_p[r] < 1, else off),
    min-p (min_logp[r] = ln(min_p), -inf off); the threshold is the greatest of the three."""
    row_ptr = x_ptr + tl.program_id(0).to(tl.int64) * stride_row
    k = tl.load(top_k_ptr + tl.program_id(0))
    p = tl.load(top_p_ptr + tl.program_id(0))
    threshold = _key(tl.load(min_logp_ptr + tl.program_id(0)))
    floor = tl.full([], -2**31, tl.int32)
    if (k >= 1) & (k < vocab):
        floor = _descend(row_ptr, vocab, floor, k.to(tl.float32), False, BLOCK, DIGIT_BITS)
    if p < 1.0:
        threshold = tl.maximum(threshold, _descend(row_ptr, vocab, floor, p, True, BLOCK, DIGIT_BITS))
    threshold = tl.maximum(threshold, floor)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offsets, mask=offsets < vocab)
        tl.store(row_ptr + offsets, tl.where(_key(x) < threshold, float("-inf"), x), mask=offsets < vocab)


def filter_in_place(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_logp: torch.Tensor) -> None:
    """x: [rows, vocab] float32, rows shifted to a maximum of 0; top_k int32 (-1 off), top_p and
    min_logp float32, one per row."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"filter_in_place needs float32 rows with contiguous values, got {x.dtype} {tuple(x.shape)}")
    if x.shape[0]:
        token_filter_kernel[(x.shape[0],)](x, top_k, top_p, min_logp, x.shape[1], x.stride(0), BLOCK=BLOCK,
                                           DIGIT_BITS=DIGIT_BITS, num_warps=WARPS)
