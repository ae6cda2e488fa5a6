"""A step's integer inputs on the device in one host-to-device copy.

On CUDA a copy from pageable memory blocks the host until the stream has drained, so every
`torch.tensor(list, device="cuda")` waits for the work before it. Inputs are therefore built
on the host, staged in pinned memory and copied with `non_blocking=True`: the host goes on
launching while the copy runs (torch's pinned allocator keeps the staging buffer until the
copy is done). The only wait left in a step is reading the sampled ids back.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitserve.engine.model_runner import StepBatch


def upload(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without waiting for the device; into `out` when given."""
    if device.type == "cuda":
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device, non_blocking=True)


def upload_list(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)


@dataclass(frozen=True)
class StepTensors:
    """Views into one device buffer."""

    token_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slots: torch.Tensor         # [groups, T]
    query_starts: torch.Tensor  # [num_seqs + 1]
    context_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [groups, num_seqs, width]

    @classmethod
    def upload(cls, batch: StepBatch, device: torch.device) -> StepTensors:
        tokens, seqs = len(batch.token_ids), len(batch.context_lens)
        groups, _, width = batch.block_tables.shape
        lists = torch.tensor(list(chain(batch.token_ids, batch.positions, *batch.slots, batch.query_starts,
                                        batch.context_lens)), dtype=torch.long)
        flat = torch.cat([lists, batch.block_tables.flatten()])
        ids, positions, slots, starts, lens, tables = upload(flat, device).split(
            [tokens, tokens, groups * tokens, seqs + 1, seqs, groups * seqs * width])
        return cls(ids, positions, slots.view(groups, tokens), starts, lens, tables.view(groups, seqs, width))
