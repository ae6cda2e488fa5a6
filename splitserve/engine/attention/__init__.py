"""Attention backends behind one interface.

- `torch`: pure-torch paged attention, the correctness oracle and the CPU path.
- `triton`: Triton kernels over the paged cache, on CUDA (on CPU only under Triton's
  interpreter, `TRITON_INTERPRET=1`, which is how the tests check it).
- `flash-attn`: the Triton backend with a FlashAttention-2 varlen kernel for a step's fresh
  prompts: the optional `flash-attn` package's, else the one CUDA builds of torch ship (sm_80 to
  sm_90). `auto` takes it on a GPU either runs on, else `triton`.
"""
import os

import torch

from splitserve.engine.attention.base import AttentionBackend
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.torch_paged import TorchPagedBackend
from splitserve.engine.config import ConfigError


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    if name == "auto" and device.type != "cuda":
        name = "torch"
    if name == "torch":
        return TorchPagedBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"attention_backend {name!r} needs CUDA (on CPU it runs only under Triton's "
                          "interpreter, TRITON_INTERPRET=1); use 'torch' or 'auto'")
    from splitserve.engine.attention.cuda import FlashAttnBackend, has_flash_kernel

    if name == "flash-attn" or (name == "auto" and has_flash_kernel(device)):
        return FlashAttnBackend(device)
    from splitserve.engine.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedBackend", "select_backend"]
