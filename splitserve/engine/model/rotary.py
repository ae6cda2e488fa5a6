"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), with linear, llama3, YaRN
and LongRoPE scaling.

LongRoPE (Phi-3.5, Phi-4-mini) has two sets of frequencies, for sequences within the trained
context and past it. Its tables hold both, the long set's rows after the short set's, and a token
reads the row `table_rows` gives it: which set depends on its sequence's length
(`ModelConfig.long_rope_from`), so a step's tokens can mix them."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from splitserve.engine.config import ModelConfig, RopeScaling
from splitserve.engine.model import triton_dispatch

if TYPE_CHECKING:
    from splitserve.engine.model.llama import RMSNorm


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """`long`: LongRoPE's set for sequences past the trained context (else its short set)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "longrope":
        return inv_freq / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, scaling)
    return inv_freq


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by (so q.k by its square): YaRN's attention temperature,
    0.1 ln(factor) + 1 unless the config sets it (or DeepSeek's mscale terms); LongRoPE's,
    sqrt(1 + ln(factor) / ln(trained context)); 1 otherwise."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        if scaling.factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))

    def temperature(weight: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * weight * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return temperature(scaling.mscale) / temperature(scaling.mscale_all_dim)
    return temperature(1.0)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al., 2023): a frequency pair that turns more than beta_fast times over the
    trained context keeps its frequency, one that turns less than beta_slow times is interpolated
    (divided by factor), and a linear ramp over the pair index blends the band between."""
    def pair_index(turns: float) -> float:  # the (fractional) pair that turns `turns` times
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    interpolated = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s.factor * interpolated + inv_freq * (1 - interpolated)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_len, computed once in float32 on the current
    default device and cast per use (as Hugging Face does), scaled by `attention_factor`. Plain
    tensors, not buffers, so that converting the model's dtype never rounds them."""

    def __init__(self, config: ModelConfig, max_len: int):
        self.dims = config.rotary_dim or config.head_dim  # the leading dims turned; the rest pass through
        self.interleaved = config.rotary_interleaved  # GLM-4's: pairs (2i, 2i + 1), not (i, i + dims / 2)
        self.long_from, self.long_offset = config.long_rope_from, max_len  # LongRoPE: where the long rows start
        sets = [False] if self.long_from is None else [False, True]
        freqs = torch.cat([torch.arange(max_len, dtype=torch.float32)[:, None] *
                           inverse_frequencies(self.dims, config.rope_theta, config.rope_scaling, long)[None, :]
                           for long in sets])
        # each frequency for dims i and i + dims / 2, or for neighbours 2i and 2i + 1 (`interleaved`)
        emb = torch.repeat_interleave(freqs, 2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(config.rope_scaling)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale

    def table_rows(self, start: int, end: int, num_tokens: int) -> range:
        """The table rows of positions [start, end) of a sequence of `num_tokens` tokens: the
        positions themselves, or the long rows where LongRoPE turns the sequence long."""
        if self.long_from is None or num_tokens <= self.long_from:
            return range(start, end)
        return range(start + self.long_offset, end + self.long_offset)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 norms: tuple[RMSNorm, RMSNorm] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], each head normalized by `norms` first where given (Qwen3's
        q and k norms), rotated (their first `dims` dims) by the table rows `positions` [T]
        (`table_rows`); on CUDA in place, both in one Triton kernel (`triton_ops`), which normalizes
        them too where the rotation covers whole heads."""
        d = self.dims
        if triton_dispatch.runs_kernels(q):
            # the attention builds q's and k's norms alike (one eps, one kind): one kernel takes both
            fused = norms is not None and d == q.shape[-1] and all(
                getattr(n, "gemma", None) is not None and n.weight.dtype == q.dtype for n in norms)  # RMSNorms alone
            if norms is not None and not fused:
                q, k = norms[0](q), norms[1](k)
            weights = (norms[0].weight, norms[1].weight, norms[0].eps, norms[0].gemma) if fused else None
            triton_dispatch.ops().rotate_in_place(positions, q[..., :d], k[..., :d], self.cos, self.sin, weights,
                                                  self.interleaved)
            return q, k
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        rotate = _rotate_pairs if self.interleaved else _rotate_half
        if d == q.shape[-1]:
            return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        turned = [x[..., :d] * cos + rotate(x[..., :d]) * sin for x in (q, k)]
        return torch.cat((turned[0], q[..., d:]), dim=-1), torch.cat((turned[1], k[..., d:]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(-x1, x0, -x3, x2, ...): each neighbouring pair turned a quarter."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
