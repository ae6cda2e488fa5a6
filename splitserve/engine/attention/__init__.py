"""Attention backends behind one interface.

- `torch`: pure-torch paged attention, the correctness oracle and the CPU path.
- `triton`: Triton kernels over the paged cache, the default on CUDA (on CPU only under Triton's
  interpreter, `TRITON_INTERPRET=1`, which is how the tests check it).
- `flash-attn`: the Triton backend with flash-attn's varlen kernel for steps whose prefills are
  all fresh prompts, where the optional `flash-attn` package is installed.
"""
import os

import torch

from splitserve.engine.attention.base import AttentionBackend
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.torch_paged import TorchPagedBackend
from splitserve.engine.config import ConfigError


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchPagedBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"attention_backend {name!r} needs CUDA (on CPU it runs only under Triton's "
                          "interpreter, TRITON_INTERPRET=1); use 'torch' or 'auto'")
    if name == "flash-attn":
        from splitserve.engine.attention.cuda import FlashAttnBackend

        return FlashAttnBackend()
    from splitserve.engine.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedBackend", "select_backend"]
