"""Which tokens a randomly sampled row may still draw: top-k, then top-p over what top-k kept,
then min-p, as transformers' `TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper` keep
them. Each keeps a row's values from a threshold up, so a value tied with the least one kept is
kept too (transformers splits such ties in its sort's order).

This is the CPU path and the oracle of the CUDA path's kernel (`triton_sampling`, which finds the
same thresholds without sorting: `triton_token_filters`): a top-k for top-k, a sort of the row
for top-p.
"""
from __future__ import annotations

import math

import torch

from splitserve.engine.step_inputs import upload_list


def filter_tokens(scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """scaled: a batch's rows of logits over their temperatures, each shifted to a maximum of 0, with
    what the filters drop set to -inf; top_k -1, top_p 1.0 and min_p 0 are off."""
    return apply_min_p(apply_top_k_top_p(scaled, top_k, top_p), min_p)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top-k (-1: off) and then top-p (1.0: off) drop, per row."""
    if any(k != -1 for k in top_k):
        logits = _apply_top_k(logits, top_k)
    if any(p < 1 for p in top_p):
        logits = _apply_top_p(logits, top_p)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Masks to -inf the tokens less likely than min_p times the row's top token (0: off), compared
    as logits (ln(min_p) below the row's maximum); the top token always stays."""
    if not any(p > 0 for p in min_p):
        return logits
    floor = logits.amax(dim=-1, keepdim=True) + min_logp(min_p, logits.device).unsqueeze(1)
    return logits.masked_fill(logits < floor, float("-inf"))


def min_logp(min_p: list[float], device: torch.device) -> torch.Tensor:
    """ln(min_p) per row, float32 (-inf where off), the one both paths compare against."""
    return upload_list([math.log(p) if p > 0 else -math.inf for p in min_p], torch.float32, device)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keeps values >= the row's k-th largest (ties included); a topk, not a full sort. A k of at
    least the vocabulary keeps every value, as -1 does (and is never uploaded: it may pass int64)."""
    vocab, device = logits.shape[1], logits.device
    off = [not 0 < k < vocab for k in top_k]
    if all(off):
        return logits
    ks = [1 if o else k for k, o in zip(top_k, off)]
    kth_largest = logits.topk(max(ks), dim=-1).values.gather(1, upload_list(ks, torch.long, device).unsqueeze(1) - 1)
    kth_largest.masked_fill_(upload_list(off, torch.bool, device).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keeps the most likely values whose mass reaches top_p, always the top one: in ascending order,
    what lies wholly within the bottom 1 - top_p of the mass is dropped."""
    ascending = logits.sort(dim=-1).values
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_below <= 1 - upload_list(top_p, torch.float32, logits.device).unsqueeze(1)
    drop[:, -1] = False
    least_kept = ascending.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < least_kept, float("-inf"))
