"""The Triton backend with flash-attn's varlen kernel for steps whose prefills are all fresh
prompts (no earlier context in the cache), where the optional `flash-attn` package is installed
(`attention_backend: flash-attn`); chunks, prefix-cache hits, attention sinks and an FP8 cache
(which flash-attn 2 lacks) take the Triton kernel."""
from __future__ import annotations

import torch

from splitserve.engine.attention import fp8_kv
from splitserve.engine.attention.base import Scoring
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.triton_paged import TritonPagedBackend
from splitserve.engine.config import ConfigError

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # flash-attn is the optional `gpu` extra
    flash_attn_varlen_func = None


class FlashAttnBackend(TritonPagedBackend):
    name = "flash-attn"

    def __init__(self, **kwargs):
        if flash_attn_varlen_func is None:
            raise ConfigError("attention_backend 'flash-attn' needs the flash-attn package "
                              "(pip install 'splitserve[gpu]'); 'triton' needs nothing more")
        super().__init__(**kwargs)

    def attend_prefills(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor,
                        window: int | None = None, scoring: Scoring = Scoring(),
                        kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
        first, starts = meta.num_decodes, meta.query_starts
        fresh = all(starts[i + 1] - starts[i] == meta.context_lens_list[i] for i in range(first, meta.num_seqs))
        if (not fresh or q.dtype not in (torch.float16, torch.bfloat16) or scoring.sinks is not None
                or fp8_kv.holds_codes(kv_cache)):
            return self.prefill(q, kv_cache, meta, out, window, scoring, kv_scale)
        lo = starts[first]  # prefill tokens follow the decodes, contiguous
        cu = (meta.query_start_tensor[first:] - lo).to(torch.int32)
        longest = max(starts[i + 1] - starts[i] for i in range(first, meta.num_seqs))
        out[lo:] = flash_attn_varlen_func(q[lo:], k[lo:], v[lo:], cu, cu, longest, longest, causal=True,
                                          softmax_scale=scoring.scale, softcap=scoring.softcap or 0.0,
                                          window_size=(-1, -1) if window is None else (window - 1, 0))
