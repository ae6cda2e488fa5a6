"""The attention-backend interface: write this step's K/V into the paged cache, then attend."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from splitserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D].
        Writes k, v at meta.slot_mapping, returns causal attention output [T, H, D]."""


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
