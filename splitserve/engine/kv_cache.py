"""The paged KV cache tensors: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim],
in the serving dtype or, with kv_cache_dtype fp8, as e4m3 codes (`attention.fp8_kv`: uint8).
A block holds the KV of one layer group's layers (`kv_groups`: every layer, unless some slide and
others do not), so the data is [group size, 2, ...] and a layer is its slot's view.

Block ids come from the `BlockManager`; this class only stores. A KV transfer reads and writes it
through `splitserve.transfer.codec`. Its size: `memory_profile.kv_cache_budget`.
"""
from __future__ import annotations

import torch

from splitserve.engine.attention import fp8_kv
from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.model.sharding import Shard, kv_head_range

CPU_KV_CACHE_BYTES = 256 * 2**20  # default KV budget on CPU (small models; set kv_cache_memory_bytes for more)


def local_kv_heads(config: ModelConfig, shard: Shard) -> int:
    lo, hi = kv_head_range(config.num_key_value_heads, shard.rank, shard.size)
    return hi - lo


class KVCache:
    """One rank's cache: with tensor parallelism, only the KV heads that rank holds (`shard`).
    `dtype`: the serving dtype, what attention reads the cache as."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 shard: Shard = Shard(), kv_cache_dtype: str = "auto"):
        self.block_size, self.shard, self.dtype = block_size, shard, dtype
        self.groups = kv_groups(config)
        shape = (self.groups.size, 2, num_blocks, block_size, local_kv_heads(config, shard), config.head_dim)
        # zeros, not empty: masked-out slots are multiplied by zero probabilities, and NaN * 0 is NaN
        self.data = torch.zeros(shape, dtype=fp8_kv.storage_dtype(kv_cache_dtype, dtype), device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, shard: Shard = Shard(),
                        kv_cache_dtype: str = "auto") -> int:
        per_token = 2 * kv_groups(config).size * local_kv_heads(config, shard) * config.head_dim
        return per_token * block_size * fp8_kv.storage_dtype(kv_cache_dtype, dtype).itemsize

    @property
    def encoding(self) -> str:
        """What the cache holds, as the KV layout handshake names it: fp8_e4m3, or the serving dtype."""
        return "fp8_e4m3" if fp8_kv.holds_codes(self.data) else str(self.dtype).removeprefix("torch.")

    @property
    def block_bytes(self) -> int:
        """One block id's bytes: its slice of every layer of its group, K and V."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.groups.slot_of)

    def layer(self, layer: int) -> torch.Tensor:
        """A [2 (K, V), num_blocks, block_size, kv_heads, head_dim] view: the layer's slot, read
        through its group's block tables."""
        return self.data[self.groups.slot_of[layer]]

    def layers(self) -> list[torch.Tensor]:
        """Every layer's `layer` view."""
        return [self.data[slot] for slot in self.groups.slot_of]
