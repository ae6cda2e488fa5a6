"""LoRA adapters loaded and unloaded while an engine serves (vLLM's `load_lora_adapter`).

An engine with `max_loras` slots (`EngineConfig`) holds every projection's adapter buffers at
`max_lora_rank` from the start, and up to `max_cpu_loras` adapters in host memory
(`lora_store`): a load reads the adapter into host memory, and a slot takes it when a sequence
under it is admitted (`lora_residency`), so nothing on the device is resized or allocated while
serving. An unload only stops new requests from naming the adapter: what runs or waits under it
finishes under it, and it leaves host memory after. With tensor parallelism every rank reads the
adapter into its own store and writes its own slice into a slot (commands in the next round).
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.engine.config import ConfigError
from splitserve.engine.kv_memory_check import free_bytes
from splitserve.engine.loader import CheckpointError
from splitserve.engine.lora_adapter import RunTimeLimits, find_weights_file, load_adapter
from splitserve.engine.lora_residency import AdapterResidency
from splitserve.engine.model.lora import LoraSlots, LoraWeights, pack_adapter, write_packed
from splitserve.engine.sampling_params import MAX_LORA_NAME, SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.tp_step import TPLeader

FILE_SLACK_BYTES = 1 << 20  # a weights file's header and names, past its tensors
HOST_HEADROOM_BYTES = 1 << 30  # host memory a load leaves free (the worker's own growth, its requests' tensors)


class AdapterNotLoaded(ValueError):
    """An unload names no adapter the engine holds."""


class NoAdapterSlot(RuntimeError):
    """Host memory holds `max_cpu_loras` adapters, loaded or still in use since their unload, or
    has too little free for another."""


@dataclass(frozen=True)
class StoreAdapter:
    """A tensor-parallel rank's part of a load: read the adapter into its host memory."""

    name: str
    path: str
    limits: RunTimeLimits

    def apply(self, model: nn.Module) -> None:
        slots: LoraSlots = model.lora_slots
        slots.host.keep(pack_adapter(model, slots, load_adapter(self.name, self.path, self.limits)))


@dataclass(frozen=True)
class WriteSlot:
    """A tensor-parallel rank's part of a swap: its slice of adapter `identity` into `slot`."""

    slot: int
    identity: str

    def apply(self, model: nn.Module) -> None:
        write_packed(model, self.slot, model.lora_slots.host.adapters[self.identity])


@dataclass(frozen=True)
class DropAdapters:
    """A tensor-parallel rank's part of an unload: let go of adapters nothing uses."""

    identities: tuple[str, ...]

    def apply(self, model: nn.Module) -> None:
        model.lora_slots.host.drop(self.identities)


class EngineAdapters:
    """An engine's LoRA adapters: those a request may name, held in host memory; the device slots
    they take turns in (`residency`, through which the scheduler binds sequences; None for a model
    without slots); loads and unloads while serving. `in_use()`: the adapter identities of the
    sequences the engine holds (what must stay in host memory)."""

    def __init__(self, model: nn.Module, tp_leader: TPLeader | None, in_use: Callable[[], Collection[str]],
                 patience: int):
        self.model, self.slots, self.tp_leader, self._in_use = model, model.lora_slots, tp_leader, in_use
        self.residency = AdapterResidency(self.slots.identity, self._write_slot, patience) \
            if self.slots.capacity else None

    @property
    def identities(self) -> dict[str, str]:
        """Each adapter a request may name -> its identity (what its prefix-cache blocks chain from), in load order."""
        return dict(self.slots.host.names)

    def identity_of(self, params: SamplingParams) -> str | None:
        """The identity of the adapter `params` names (None: the base model); a ValueError naming
        `lora` for one not loaded, or loaded again since the request was placed under it."""
        if params.lora is None:
            return None
        identity = self.slots.host.names.get(params.lora)
        if identity is None:
            raise ValueError(f"lora: no adapter named {params.lora!r} is loaded (loaded: "
                             f"{', '.join(self.slots.host.names) or 'none'})")
        if params.lora_identity is not None and identity != params.lora_identity:
            raise ValueError(f"lora: the adapter named {params.lora!r} here is not the one the request was placed "
                             "under (it was loaded again meanwhile)")
        return identity

    def load(self, name: str, path: str) -> str:
        """Load the adapter at `path` as `name` into host memory; its identity. A bad name, path or
        adapter is a ConfigError (nothing changes), a name already loaded a ValueError, host memory
        full (`max_cpu_loras`, or too little free) a NoAdapterSlot."""
        slots = self.slots
        if not slots.at_run_time:
            raise ConfigError("lora: adapters are not loaded at run time (max_loras is 0: only lora_modules)")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
            raise ConfigError(f"lora_name must be 1 to {MAX_LORA_NAME} characters, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"lora_path must be a directory's path, got {path!r}")
        if name in slots.host.names:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded (unload it first)")
        self._purge()
        if slots.host.full():
            raise NoAdapterSlot(f"lora: all {slots.host.capacity} adapters host memory holds (max_cpu_loras) are "
                                f"taken: {len(slots.host.names)} by loaded adapters, the rest by unloaded ones still "
                                "running requests")
        tp_size = 1 if self.tp_leader is None else self.tp_leader.group.size
        weights = [module for module in self.model.modules() if isinstance(module, LoraWeights)]
        _check_host_memory(weights, name, path, tp_size)
        limits = RunTimeLimits(slots.rank, _max_file_bytes(weights, slots.rank, tp_size))
        adapter = pack_adapter(self.model, slots, load_adapter(name, path, limits))
        if self.tp_leader is not None:
            self.tp_leader.post_all(StoreAdapter(name, path, limits))
            self.tp_leader.sync()
        slots.host.add(adapter)
        return adapter.identity

    def unload(self, name: str) -> None:
        """New requests may no longer name `name`; it leaves host memory once nothing runs or waits
        under it (AdapterNotLoaded if none is loaded by that name)."""
        if name not in self.slots.host.names:
            raise AdapterNotLoaded(f"lora_name: no adapter named {name!r} is loaded (loaded: "
                                   f"{', '.join(self.slots.host.names) or 'none'})")
        del self.slots.host.names[name]
        self._purge()

    def _purge(self) -> None:
        """Let go of the adapters no name and no sequence refers to, in host memory and in the slots."""
        gone = self.slots.host.purge(self._in_use())
        if gone and self.residency is not None:
            self.residency.forget(gone)
        if gone and self.tp_leader is not None:
            self.tp_leader.post_all(DropAdapters(tuple(gone)))

    def _write_slot(self, slot: int, identity: str) -> None:
        """Adapter `identity` from host memory into `slot` (a swap, between steps), on every rank."""
        write_packed(self.model, slot, self.slots.host.adapters[identity])
        if self.tp_leader is not None:
            self.tp_leader.post_all(WriteSlot(slot, identity))


def _check_host_memory(weights: list[LoraWeights], name: str, path: str, tp_size: int) -> None:
    """NoAdapterSlot where reading the adapter (up to 4 times its file on the way: the file's
    tensors, them in float32, B scaled) and keeping it packed in `weights`' layout, on every rank
    of a tensor-parallel worker (one node), would leave less than HOST_HEADROOM_BYTES free: the
    worker would be killed for memory instead."""
    try:
        file_bytes = find_weights_file(Path(path)).stat().st_size
    except (CheckpointError, OSError):
        return  # load_adapter says what is wrong with the path
    packed = sum(w.a[0].nbytes + w.b[0].nbytes for w in weights)
    need, free = tp_size * (4 * file_bytes + packed), free_bytes(torch.device("cpu"))
    if free is not None and need + HOST_HEADROOM_BYTES > free:
        raise NoAdapterSlot(f"lora: loading adapter {name!r} takes up to {need} bytes of host memory, but {free} are "
                            f"free, of which {HOST_HEADROOM_BYTES} stay free (max_cpu_loras sets how many adapters "
                            "are held)")


def _max_file_bytes(weights: list[LoraWeights], rank: int, tp_size: int) -> int:
    """A bound on an adapter file's size: every projection adapted at `rank` in float32 (this
    rank's shapes times the ranks, more than the whole model's)."""
    numel = sum((len(w.part_rows) * w.a.shape[-1] + w.b.shape[1]) * rank for w in weights)
    return 4 * numel * tp_size + FILE_SLACK_BYTES
