"""CUDA attention: flash-attn's varlen kernel for fresh fp16/bf16 prefills when it is importable, else the
torch path (SDPA, which dispatches to its own flash/efficient kernels on CUDA); decodes and
chunks with earlier context use the torch paged path on the device."""
from __future__ import annotations

import torch

from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.torch_paged import TorchPagedBackend

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # flash-attn is the optional `gpu` extra
    flash_attn_varlen_func = None


class CudaBackend(TorchPagedBackend):
    name = "cuda-flash-attn" if flash_attn_varlen_func is not None else "cuda-sdpa"

    def run_prefills(self, q, k, v, kv_cache, meta: AttentionMetadata, out, seqs) -> None:
        fresh = [i for i in seqs if meta.query_starts[i + 1] - meta.query_starts[i] == meta.context_lens_list[i]]
        if flash_attn_varlen_func is None or not fresh or q.dtype not in (torch.float16, torch.bfloat16):
            return super().run_prefills(q, k, v, kv_cache, meta, out, seqs)
        super().run_prefills(q, k, v, kv_cache, meta, out, [i for i in seqs if i not in fresh])
        spans = [(meta.query_starts[i], meta.query_starts[i + 1]) for i in fresh]
        index = torch.cat([torch.arange(lo, hi, device=q.device) for lo, hi in spans])
        lens = torch.tensor([0] + [hi - lo for lo, hi in spans], device=q.device)
        cu = torch.cumsum(lens, 0, dtype=torch.int32)
        max_len = int(lens.max())
        out[index] = flash_attn_varlen_func(q[index], k[index], v[index], cu, cu, max_len, max_len, causal=True)
