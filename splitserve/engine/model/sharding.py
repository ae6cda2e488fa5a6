"""Megatron-style sharding of the Llama family over a worker's tensor-parallel ranks.

Rank r of N holds:
- attention: query heads [r*H/N, (r+1)*H/N) and the KV heads they read (`kv_head_range`): a
  contiguous 1/N of the KV heads, or, with fewer KV heads than ranks, the one KV head its query
  heads share (replicated on N/K ranks). Q, K and V are column-parallel (rows of the checkpoint's
  weights), o_proj row-parallel (its columns), followed by an all-reduce;
- MLP: gate and up column-parallel, down row-parallel, then an all-reduce; a sparse (MoE) layer's
  experts likewise, each expert's slice of its width on every rank, and its router replicated;
- replicated: the embedding and the norms; the LM head lives on rank 0 only (the rank that samples),
  except where it is tied to the embedding.
A rank's KV cache holds its own KV heads for every block id; the block manager runs on rank 0 and
its ids mean the same blocks on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.config import ConfigError, ModelConfig

MAX_RANKS = 64  # ranks of one worker (a node's devices, with room)


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    def split(self, total: int) -> tuple[int, int]:
        """This rank's equal part [start, stop) of `total` (a multiple of size)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def split_in(self, total: int, unit: int) -> tuple[int, int]:
        """This rank's part [start, stop) of `total` (whole units) in whole units, the first ranks
        a unit more where the ranks do not divide them (2880 in 32s over 4: 736, 736, 704, 704)."""
        units, extra = divmod(total // unit, self.size)
        start = self.rank * units + min(self.rank, extra)
        return unit * start, unit * (start + units + (self.rank < extra))


@dataclass(frozen=True)
class ShardSlice:
    """Which part of a checkpoint tensor a rank holds: indices [start, stop) of `total` along `dim`."""

    dim: int
    start: int
    stop: int
    total: int

    def full_shape(self, part_shape: torch.Size) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape, given the part's."""
        return tuple(self.total if i == self.dim else n for i, n in enumerate(part_shape))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.stop - self.start)

    def in_units(self, unit: int) -> "ShardSlice":
        """The same part of a tensor with one entry per `unit` (FP8's block scales; the bounds whole units)."""
        return ShardSlice(self.dim, self.start // unit, self.stop // unit, -(-self.total // unit))


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads [lo, hi) rank `rank` of `size` holds (see the module docstring)."""
    if num_kv_heads >= size:
        return Shard(rank, size).split(num_kv_heads)
    head = rank * num_kv_heads // size
    return head, head + 1


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ConfigError naming the field when the model cannot be split over `size` ranks."""
    if not 1 <= size <= MAX_RANKS:
        raise ConfigError(f"tensor_parallel_size must be in [1, {MAX_RANKS}], got {size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(f"tensor_parallel_size={size} neither divides nor is a multiple of "
                          f"num_key_value_heads={kv_heads}")
    if config.intermediate_size % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide intermediate_size={config.intermediate_size}")
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, field) % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide {field}={getattr(config, field)}")
