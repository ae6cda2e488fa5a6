"""The sampler's draw for randomly sampled rows on CUDA, in one launch: temperature, top-k, top-p,
min-p and the inverse-CDF draw, reading each row's logits where they lie and writing one id a row.
The torch path (`sampler`, the CPU path and this kernel's oracle) gathers the rows, shifts them,
divides them, filters them, takes a softmax, its cumulative sum and a search, each a pass over
[rows, vocab] in memory.

One program per row:
- the row's maximum, read at the greedy id the caller put in the output (its argmax, which the
  sampler takes for every row anyway); a row with no finite logit keeps that id, as the torch path
  keeps it;
- the filters' threshold (`triton_token_filters`: no pass without filters, eight for top-k, eight
  for top-p), on the values (logit - maximum) / temperature computed as torch computes them;
- the mass of the values kept, exp(value) (a pass);
- the draw: blocks in vocabulary order until the running mass reaches u times the whole (half a
  pass on average), the token the first kept one (exp > 0) whose running mass reaches it, so a
  token of probability 0 is never drawn.
Both sums add each block's cumulative sum's maximum to a running total in the same order, so the
draw meets the total the target was scaled by and always reaches it while cumulative sums grow
(where rounding left one short of it, the row would keep its greedy id). Torch's cumulative sum
rounds otherwise, so the two paths draw different tokens only where a target falls within
rounding of a boundary between two tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.step_inputs import upload_list
from splitserve.engine.token_filters import min_logp
from splitserve.engine.triton_token_filters import DIGIT_BITS, key, scaled, threshold

BLOCK = 512          # values the filters' descent bins at a time, a value a thread
STREAM_BLOCK = 2048  # values a streaming pass (mass, draw) reads at a time (4096 spilled on sm_90)
WARPS = 8  # two values a thread in the descent: with 16 (one) triton 3.6 spilled registers on sm_90, and
           # the loops issued more warp instructions a value (bench_sampler.py --warps 16 times them)
SMALLEST_TOP_P = 1e-30  # > 0 in float32, and below any top token's share (>= 1 / vocab)


@triton.jit
def draw_kernel(logits_ptr, rows_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_logp_ptr, uniform_ptr, out_ptr,
                vocab, stride_row, BLOCK: tl.constexpr, STREAM_BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """out[rows[i]] = a draw from logits row rows[i] at temperature[i] (> 0) with top_k[i] (in
    [1, vocab), else off), top_p[i] (< 1, else off) and min_logp[i] (ln(min_p), -inf off), for
    u = uniform[i] in (0, 1]; out[rows[i]] holds the row's argmax on entry, where its maximum is read."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    row_ptr = logits_ptr + row * stride_row
    row_max = tl.load(row_ptr + tl.load(out_ptr + row))
    if row_max > float("-inf"):
        temperature = tl.load(temperature_ptr + i)
        least = threshold(row_ptr, vocab, row_max, temperature, tl.load(top_k_ptr + i), tl.load(top_p_ptr + i),
                          tl.load(min_logp_ptr + i), BLOCK, DIGIT_BITS)
        total = 0.0
        for start in range(0, vocab, STREAM_BLOCK):
            offsets = start + tl.arange(0, STREAM_BLOCK)
            total += tl.max(tl.cumsum(_kept_mass(row_ptr, offsets, vocab, row_max, temperature, least), axis=0), axis=0)
        target = tl.load(uniform_ptr + i) * total
        before = 0.0  # the mass of the blocks before `start`
        chosen = vocab  # none yet
        start = 0
        while (chosen == vocab) & (start < vocab):
            offsets = start + tl.arange(0, STREAM_BLOCK)
            mass = _kept_mass(row_ptr, offsets, vocab, row_max, temperature, least)
            running = tl.cumsum(mass, axis=0)
            chosen = tl.min(tl.where((before + running >= target) & (mass > 0.0), offsets, vocab), axis=0)
            before += tl.max(running, axis=0)
            start += STREAM_BLOCK
        if chosen < vocab:
            tl.store(out_ptr + row, chosen.to(tl.int64))


@triton.jit
def _kept_mass(row_ptr, offsets, vocab, row_max, temperature, least):
    """exp(value) of the kept values at `offsets` (keys from `least` up), 0 for the rest."""
    x = scaled(row_ptr, offsets, vocab, row_max, temperature)
    return tl.where(key(x) >= least, tl.exp(x), 0.0)


def draw(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, top_k: list[int], top_p: list[float],
         min_p: list[float], uniforms: torch.Tensor, token_ids: torch.Tensor) -> None:
    """token_ids[rows[i]] = a draw from logits[rows[i]] (float32, values contiguous) at temperatures[i]
    with top_k[i] (-1 off), top_p[i] (1.0 off), min_p[i] (0 off) for uniforms[i] in (0, 1].
    token_ids holds each row's argmax on entry (the greedy ids); a row with no finite logit keeps it."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"draw needs float32 rows with contiguous values, got {logits.dtype} {tuple(logits.shape)}")
    if rows.shape[0]:
        draw_kernel[(rows.shape[0],)](logits, rows, temperatures, *filter_settings(top_k, top_p, min_p, logits),
                                      uniforms, token_ids, logits.shape[1], logits.stride(0), BLOCK=BLOCK,
                                      STREAM_BLOCK=STREAM_BLOCK, DIGIT_BITS=DIGIT_BITS, num_warps=WARPS)


def filter_settings(top_k: list[int], top_p: list[float], min_p: list[float],
                    logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`threshold`'s k (int32), p and ln(min_p) (float32) per row, on the logits' device."""
    device, vocab = logits.device, logits.shape[1]
    # a k of the whole vocabulary keeps it all; a top_p too small for float32 keeps the top token alone
    return (upload_list([k if 0 < k < vocab else -1 for k in top_k], torch.int32, device),
            upload_list([max(p, SMALLEST_TOP_P) for p in top_p], torch.float32, device), min_logp(min_p, device))
