"""The attention-backend interface: write this step's K/V into the paged cache, then attend."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention import fp8_kv
from splitserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    graph_safe = False  # decode steps need no host-side metadata but bounds, so a CUDA graph can replay them

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, window: int | None = None, scale: float | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: one layer's [2 (K, V), num_blocks, block_size, KVH, D],
        values in q's dtype or, uint8, FP8 codes of them (`fp8_kv`; `kv_scale`: K's and V's scales).
        Writes k, v at meta.slot_mapping, returns causal attention output [T, H, D]. `window`: a
        query at position p attends only to positions > p - window (a sliding-window layer);
        `scale`: of q.k (None: head_dim ** -0.5); `softcap`: scores become softcap * tanh(scores / softcap);
        `sinks`: [H] (any float dtype, read as float32), contiguous, on q's device: head h's softmax
        also counts a key of score sinks[h] that has no value (GPT-OSS)."""


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v into the cache at `slot_mapping`, as FP8 codes where it holds them; returns them as a
    read of the cache returns them."""
    stored = k, v
    if fp8_kv.holds_codes(kv_cache):
        codes = fp8_kv.quantize(k, kv_scale[0]), fp8_kv.quantize(v, kv_scale[1])
        stored = tuple(fp8_kv.dequantize(c, s, k.dtype) for c, s in zip(codes, kv_scale))
        k, v = codes
    kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
    return stored


@dataclass(frozen=True, eq=False)
class Scoring:
    """How scores are made and weighed: q.k times `scale` (None: head_dim ** -0.5), then, with a
    `softcap`, softcap * tanh(scores / softcap) (Gemma 2); with `sinks` ([H]), head h's
    softmax runs over its scores and one more logit, sinks[h], never masked and with no value, so
    the weights of the keys sum to less than 1 (GPT-OSS). SDPA can do neither: those are computed here."""

    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        """SDPA makes the scores: none are held here."""
        return self.softcap is None and self.sinks is None

    def attend(self, q, k, v, mask=None, is_causal: bool = False) -> torch.Tensor:
        """q [B, H, Lq, D], k and v [B, KVH, Lk, D] (KVH divides H); mask broadcast to [B, H, Lq, Lk]."""
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                                  enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if is_causal:  # the queries are the last Lq positions
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)
        sinks = self.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.cat((scores, sinks), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's column has no value
        return (weights @ v.float()).to(q.dtype)
