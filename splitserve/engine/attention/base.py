"""The attention-backend interface: write this step's K/V into the paged cache, then attend."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from splitserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    graph_safe = False  # decode steps need no host-side metadata but bounds, so a CUDA graph can replay them

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: one layer's [2 (K, V), num_blocks, block_size, KVH, D].
        Writes k, v at meta.slot_mapping, returns causal attention output [T, H, D]. `window`: a
        query at position p attends only to positions > p - window (a sliding-window layer)."""


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
