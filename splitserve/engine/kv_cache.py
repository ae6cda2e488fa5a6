"""The paged KV cache tensors: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim].

Block ids come from the `BlockManager`; this class only stores. A KV transfer reads and writes it
through `splitserve.transfer.codec`. Its size: `memory_profile.kv_cache_budget`.
"""
from __future__ import annotations

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.sharding import Shard, kv_head_range

CPU_KV_CACHE_BYTES = 256 * 2**20  # default KV budget on CPU (small models; set kv_cache_memory_bytes for more)


def local_kv_heads(config: ModelConfig, shard: Shard) -> int:
    lo, hi = kv_head_range(config.num_key_value_heads, shard.rank, shard.size)
    return hi - lo


class KVCache:
    """One rank's cache: with tensor parallelism, only the KV heads that rank holds (`shard`)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 shard: Shard = Shard()):
        self.block_size, self.shard = block_size, shard
        shape = (config.num_hidden_layers, 2, num_blocks, block_size, local_kv_heads(config, shard), config.head_dim)
        # zeros, not empty: masked-out slots are multiplied by zero probabilities, and NaN * 0 is NaN
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, shard: Shard = Shard()) -> int:
        per_token = 2 * config.num_hidden_layers * local_kv_heads(config, shard) * config.head_dim
        return per_token * block_size * torch.tensor([], dtype=dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def layers(self) -> list[torch.Tensor]:
        """Per layer, a [2 (K, V), num_blocks, block_size, kv_heads, head_dim] view."""
        return list(self.data)
