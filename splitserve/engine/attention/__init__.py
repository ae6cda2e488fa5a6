"""Attention backends behind one interface, chosen by device."""
import torch

from splitserve.engine.attention.base import AttentionBackend
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.torch_paged import TorchPagedBackend


def select_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from splitserve.engine.attention.cuda import CudaBackend

        return CudaBackend()
    return TorchPagedBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedBackend", "select_backend"]
