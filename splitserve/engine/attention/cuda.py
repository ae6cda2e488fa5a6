"""The Triton backend with a FlashAttention-2 varlen kernel for a step's fresh prompts (no earlier
context in the cache): flash-attn's where the optional `flash-attn` package is installed, else the
one CUDA builds of torch ship (`torch_flash`), which needs nothing more; `attention_backend:
flash-attn`, and `auto`'s choice on a GPU either runs on. Over an FP8 cache it reads the prompts'
K and V as the cache gives them back (their codes' values, rounded). Chunks with earlier context
(prefix-cache hits too) take the Triton kernel, and so does every prompt of a step with attention
sinks (which FlashAttention-2 lacks), or a soft cap with torch's kernel."""
from __future__ import annotations

import torch

from splitserve.engine.attention import fp8_kv, torch_flash
from splitserve.engine.attention.base import Scoring
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.triton_paged import TritonPagedBackend
from splitserve.engine.config import ConfigError

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # flash-attn is the optional `flash-attn` extra
    flash_attn_varlen_func = None


class _FlashAttnPackage:
    """flash-attn's varlen kernel: soft caps too."""

    @staticmethod
    def takes(q: torch.Tensor, scoring: Scoring) -> bool:
        return True

    @staticmethod
    def attend(q, k, v, cu: torch.Tensor, longest: int, scoring: Scoring, window: int | None) -> torch.Tensor:
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, softmax_scale=scoring.scale,
                                      softcap=scoring.softcap or 0.0,
                                      window_size=(-1, -1) if window is None else (window - 1, 0))


def has_flash_kernel(device: torch.device) -> bool:
    """A FlashAttention-2 kernel runs fresh prompts on `device`: flash-attn's, or torch's own."""
    return flash_attn_varlen_func is not None or torch_flash.runs_on(device)


class FlashAttnBackend(TritonPagedBackend):
    name = "flash-attn"

    def __init__(self, device: torch.device | None = None, **kwargs):
        """`device`: where it runs (None: the current CUDA device); flash-attn's kernel where the
        package is installed, else torch's where that device runs it."""
        device = device or torch.device("cuda")
        if not has_flash_kernel(device):
            raise ConfigError("attention_backend 'flash-attn' needs the flash-attn package (pip install "
                              "'splitserve[flash-attn]') or a CUDA build of torch with FlashAttention on an sm_80 "
                              "to sm_90 GPU; 'triton' needs nothing more")
        self.fresh = _FlashAttnPackage if flash_attn_varlen_func is not None else torch_flash
        super().__init__(**kwargs)

    def attend_prefills(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor,
                        window: int | None = None, scoring: Scoring = Scoring(),
                        kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
        """The fresh prompts at the batch's end (the runner puts chunks with earlier context before
        them) to the FlashAttention kernel where it takes them, the chunks before to Triton's."""
        split = meta.fresh_from
        if (split == meta.num_seqs or q.dtype not in (torch.float16, torch.bfloat16) or scoring.sinks is not None
                or not self.fresh.takes(q, scoring)):
            return self.prefill(q, kv_cache, meta, out, window, scoring, kv_scale)
        if split > meta.num_decodes:
            self.prefill(q, kv_cache, meta, out, window, scoring, kv_scale, end=split)
        lo = meta.query_starts[split]  # the fresh prompts' tokens, contiguous to the end
        keys, values = k[lo:], v[lo:]
        if fp8_kv.holds_codes(kv_cache):  # what a read of the cache returns: the codes' values, rounded
            keys, values = (fp8_kv.rounded(x, scale) for x, scale in zip((keys, values), kv_scale))
        out[lo:] = self.fresh.attend(q[lo:], keys, values, meta.fresh_query_starts, meta.fresh_longest, scoring,
                                     window)
