"""The prefix cache's host tier in a simulated worker (`engine.kv_host_cache_bytes`): the engine's
own `HostKVTier` keeps the blocks the block manager evicts (or, write-through, every block it
caches) and restores them for a prefix hit. Each block saved on eviction or restored adds `block_s`
to the iteration that makes the copy (the engine queues those copies on the device's stream
between two forwards, so they lengthen the step); blocks written through are copied on their own
stream during the next iteration and lengthen it only by what outlasts its compute. Written
through, the writes (device to host) and the restores (host to device) cross a PCIe link in
opposite directions, which it carries at once at full rate each; write-back saves and restores
are costed in full, one after the other, as the compute stream queues them."""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.engine.engine_config import KV_HOST_WRITE_POLICIES

# assumed: a worker's host links together; a DGX-H100's 8 GPUs each copy their heads' part of a block
# over a PCIe Gen5 x16 link of about 50 GB/s each way (pinned); one GPU alone: 50e9
HOST_LINK_BYTES_PER_S = 400e9
DEFAULT_WRITE_THROUGH = KV_HOST_WRITE_POLICIES[0] == "write_through"  # the engine's default policy


@dataclass(frozen=True)
class HostKVModel:
    """Each worker's host tier: `tokens` of KV in host memory, copied at `bytes_per_s`, written
    through (`engine.kv_host_write_policy`) or back."""

    tokens: int
    bytes_per_s: float = HOST_LINK_BYTES_PER_S
    write_through: bool = DEFAULT_WRITE_THROUGH

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"the host KV tier must hold at least one token, got {self.tokens!r}")
        if not (isinstance(self.bytes_per_s, (int, float)) and math.isfinite(self.bytes_per_s)
                and self.bytes_per_s > 0):
            raise ValueError(f"the host KV tier's bytes_per_s must be a finite number > 0, got {self.bytes_per_s!r}")


class WorkerHostTier(NamedTuple):
    """A simulated worker's host tier: its blocks (of one layer group's), the seconds copying one takes."""

    blocks: int
    block_s: float
    write_through: bool


class SimHostKV:
    """A simulated worker's `BlockMover`: it counts the blocks copied until an iteration pays for them."""

    def __init__(self, block_s: float):
        self.block_s, self._unpaid, self._written = block_s, 0, 0

    def save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        self._unpaid += len(block_ids)

    def write(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        self._written += len(block_ids)

    def fence(self) -> None:
        """Writes are costed where they outlast an iteration's compute (`take_cost`)."""

    def load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        self._unpaid += len(block_ids)

    def take_cost(self, compute_s: float) -> float:
        """The seconds the copies since the last take add to an iteration that computes `compute_s`."""
        cost = self._unpaid * self.block_s + max(0.0, self._written * self.block_s - compute_s)
        self._unpaid = self._written = 0
        return cost
