"""The LoRA adapters an engine holds in host memory (vLLM's `max_cpu_loras`), each packed as this
rank's adapter slots hold it, so a slot takes one (`lora_residency`) by a copy, without reading
its files again.

It holds every adapter a new request may name, and those unloaded while sequences still run
under them: those leave once nothing refers to them (`purge`). Every rank of a tensor-parallel
worker keeps its own store (its slices), changed by the leader's commands (`lora_loading`).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PackedAdapter:
    """One adapter in the slots' layout (`model.lora.pack_adapter`): per projection holding slots,
    its (A, B) on the host in the slots' dtype, or None where the adapter leaves it alone."""

    name: str
    identity: str
    weights: dict  # LoraWeights -> tuple[torch.Tensor, torch.Tensor] | None


class HostAdapters:
    """At most `capacity` adapters, by identity; `names`: those a new request may name."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.names: dict[str, str] = {}  # name -> identity, in load order
        self.adapters: dict[str, PackedAdapter] = {}  # identity -> the adapter

    def add(self, adapter: PackedAdapter) -> None:
        """Hold `adapter` under its name (the caller made room: `purge`, `full`)."""
        self.names[adapter.name] = adapter.identity
        self.keep(adapter)

    def keep(self, adapter: PackedAdapter) -> None:
        """Hold `adapter` by its identity only (a tensor-parallel rank: the leader admits by name)."""
        self.adapters.setdefault(adapter.identity, adapter)  # the same files loaded again: the same weights

    def full(self) -> bool:
        return len(self.adapters) >= self.capacity

    def purge(self, in_use: Collection[str]) -> list[str]:
        """Let go of the adapters no name and no identity in `in_use` (the sequences the engine
        holds) refers to; their identities."""
        named = set(self.names.values())
        gone = [identity for identity in self.adapters if identity not in named and identity not in in_use]
        for identity in gone:
            del self.adapters[identity]
        return gone

    def drop(self, identities: Collection[str]) -> None:
        """A tensor-parallel rank's side of the leader's `purge`."""
        for identity in identities:
            self.adapters.pop(identity, None)

    @staticmethod
    def host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` as the store keeps it: pinned where the slots are on a GPU, so a slot's copy
        does not wait on the host."""
        return tensor.pin_memory() if device.type == "cuda" else tensor
