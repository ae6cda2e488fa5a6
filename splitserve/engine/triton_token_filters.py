"""Top-k, top-p and min-p on CUDA without sorting the vocabulary and without a host sync: the
device functions `triton_sampling`'s draw finds a row's threshold with (`token_filters` is the
torch path and their oracle).

A row's values are its logits shifted by their maximum and divided by the temperature, as the
torch path computes them (the same two rounded float32 operations), read from the logits on the
fly. A float32's bits, with every bit but the sign flipped on negatives (and -0.0 taken as +0.0),
are an int32 key in the floats' order, so the threshold, the least value kept, is the key where a
running total from the top first reaches a target: the k-th largest key for top-k (counting every
value), the key where the mass, exp of the values at or above top-k's threshold, reaches top_p of
their whole mass for top-p. That key is found by a radix descent, four bits a pass over the row:
each pass sums the bucket's values by their next digit (16 bins) and keeps the bin where the
total from the top crosses the target, so eight passes leave one key. Counts are exact; masses are
float sums, so a top-p boundary can differ from the sorted cumulative sum's where the two round
differently. Min-p's threshold is a value: a row's maximum is 0, so it keeps values at or above
ln(min_p).
"""
from __future__ import annotations

import triton
import triton.language as tl

DIGIT_BITS = 4  # a pass's digit: 16 bins


@triton.jit
def key(x):
    """The int32 key of float32 values, in their order (-0.0 keyed as +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    flipped = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(flipped == -1, 0, flipped)


@triton.jit
def scaled(row_ptr, offsets, vocab, row_max, temperature):
    """The row's values at `offsets` (-inf past the vocabulary): (logit - row_max) / temperature,
    divided as torch divides (rounded to nearest)."""
    x = tl.load(row_ptr + offsets, mask=offsets < vocab, other=float("-inf"))
    return tl.math.div_rn(x - row_max, temperature)


@triton.jit
def threshold(row_ptr, vocab, row_max, temperature, k, p, min_logp, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The key of the least value the row keeps: the greatest of top-k's (k in [1, vocab), else
    off), top-p's over what top-k keeps (p < 1, else off) and min-p's (min_logp = ln(min_p), -inf
    off)."""
    least = key(min_logp)
    floor = tl.full([], -2**31, tl.int32)
    if (k >= 1) & (k < vocab):
        floor = _descend(row_ptr, vocab, row_max, temperature, floor, k.to(tl.float32), False, BLOCK, DIGIT_BITS)
    if p < 1.0:
        least = tl.maximum(least, _descend(row_ptr, vocab, row_max, temperature, floor, p, True, BLOCK, DIGIT_BITS))
    return tl.maximum(least, floor)


@triton.jit
def _descend(row_ptr, vocab, row_max, temperature, floor, goal, MASS: tl.constexpr, BLOCK: tl.constexpr,
             DIGIT_BITS: tl.constexpr):
    """The largest key t with total(keys >= t) >= target, over the row's keys >= floor: counts with
    target = goal, or (MASS) masses exp(value) with target = goal * their sum. Where rounding leaves
    no bin reaching it, the descent takes the lowest bin (keeps more). Digits are read from the
    keys with the sign bit flipped (unsigned order); a block with no key in the bucket (most, once
    the bucket is narrow) is not binned. Counts are binned by Triton's histogram (warp votes, a few
    instructions a value), masses by a compare, a select and an add a value and bin. Once the
    bucket holds at most one value, the passes left read nothing: its remaining digits stay 0, and
    its lowest key keeps what the value's own key would (no other value lies in the bucket)."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    bins = tl.arange(0, BINS)
    prefix = tl.full([], 0, tl.int32)  # the digits chosen so far, at their bits
    above = 0.0                        # the total of the keys above the bucket
    target = goal
    narrow = tl.full([], 0, tl.int32)  # 1 once the bucket holds at most one value
    for p in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (p + 1)
        binned = tl.zeros([BLOCK, BINS], tl.float32)  # masses, summed over its rows once a pass
        counted = tl.zeros([BINS], tl.int32)
        if narrow == 0:
            for start in range(0, vocab, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                x = scaled(row_ptr, offsets, vocab, row_max, temperature)
                keys = key(x)
                ordered = keys ^ (-2**31)
                member = (offsets < vocab) & (keys >= floor)
                if p > 0:
                    member = member & (((ordered ^ prefix) >> (shift + DIGIT_BITS)) == 0)
                if tl.max(member.to(tl.int32), axis=0) > 0:
                    digit = (ordered >> shift) & (BINS - 1)
                    counted += tl.histogram(digit, BINS, mask=member)
                    if MASS:
                        weight = tl.where(member, tl.exp(x), 0.0)
                        binned += tl.where(digit[:, None] == bins[None, :], weight[:, None], 0.0)
        # a narrow bucket's passes bin nothing: no bin reaches the target, so its digit is 0
        sums = tl.sum(binned, axis=0) if MASS else counted.to(tl.float32)
        from_top = tl.cumsum(sums, axis=0, reverse=True)
        if MASS and p == 0:
            target = goal * tl.sum(sums, axis=0)
        chosen = tl.max(tl.where(above + from_top >= target, bins, 0), axis=0)
        above += tl.sum(tl.where(bins > chosen, sums, 0.0), axis=0)
        prefix = prefix | (chosen << shift)
        narrow = tl.where(tl.sum(tl.where(bins == chosen, counted, 0), axis=0) <= 1, 1, 0)
    return prefix ^ (-2**31)
