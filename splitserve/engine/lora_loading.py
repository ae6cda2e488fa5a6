"""LoRA adapters loaded and unloaded while an engine serves (vLLM's `load_lora_adapter`).

An engine with `max_loras` slots (`EngineConfig`) holds every projection's adapter buffers at
`max_lora_rank` from the start, so a load only writes one slot: no buffer is resized and no
memory is allocated while serving. A load takes an empty slot, else one whose adapter was
unloaded and whose last sequence has finished; with tensor parallelism every rank reads the
adapter and writes its own slice (a command in the next round). An unload only stops new
requests from naming the adapter: what runs under it finishes under it (`model.lora`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from splitserve.engine.config import ConfigError
from splitserve.engine.lora_adapter import RunTimeLimits, load_adapter
from splitserve.engine.model.lora import LoraSlots, LoraWeights, write_adapter
from splitserve.engine.sampling_params import MAX_LORA_NAME

if TYPE_CHECKING:
    from splitserve.engine.tp_step import TPLeader

FILE_SLACK_BYTES = 1 << 20  # a weights file's header and names, past its tensors


class AdapterNotLoaded(ValueError):
    """An unload names no adapter the engine holds."""


class NoAdapterSlot(RuntimeError):
    """Every slot holds an adapter, loaded or still finishing requests since its unload."""


@dataclass(frozen=True)
class WriteAdapter:
    """A tensor-parallel rank's part of a load: read the adapter, write its slice into `slot`."""

    slot: int
    name: str
    path: str
    limits: RunTimeLimits

    def apply(self, model: nn.Module) -> None:
        write_adapter(model, model.lora_slots, self.slot, load_adapter(self.name, self.path, self.limits))


def load(model: nn.Module, name: str, path: str, bound: Iterable[int], tp_leader: TPLeader | None) -> str:
    """Load the adapter at `path` as `name` into a free slot (`bound`: the slots of the sequences
    the engine holds); its identity. A bad name, path or adapter is a ConfigError (nothing changes), a name
    already loaded a ValueError, no free slot a NoAdapterSlot."""
    slots: LoraSlots = model.lora_slots
    if not slots.at_run_time:
        raise ConfigError("lora: adapters are not loaded at run time (max_loras is 0: only lora_modules)")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
        raise ConfigError(f"lora_name must be 1 to {MAX_LORA_NAME} characters, got {name!r}")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"lora_path must be a directory's path, got {path!r}")
    if name in slots.index:
        raise ValueError(f"lora_name: an adapter named {name!r} is already loaded (unload it first)")
    slot = slots.free_slot(bound)
    if slot is None:
        raise NoAdapterSlot(f"lora: all {slots.capacity} adapter slots (max_loras) are taken: {len(slots.index)} by "
                            f"loaded adapters, the rest by unloaded ones still finishing requests")
    limits = RunTimeLimits(slots.rank, _max_file_bytes(model, slots.rank, 1 if tp_leader is None else
                                                       tp_leader.group.size))
    adapter = load_adapter(name, path, limits)
    slots.identity[slot] = None  # a slot being written holds no adapter, whatever the write leaves in it
    write_adapter(model, slots, slot, adapter)
    if tp_leader is not None:
        for rank in range(1, tp_leader.group.size):
            tp_leader.post(rank, WriteAdapter(slot, name, path, limits))
        tp_leader.sync()
    slots.index[name], slots.identity[slot] = slot, adapter.identity
    return adapter.identity


def unload(model: nn.Module, name: str) -> None:
    """New requests may no longer name `name`; its slot frees once what runs under it finishes."""
    slots: LoraSlots = model.lora_slots
    if name not in slots.index:
        raise AdapterNotLoaded(f"lora_name: no adapter named {name!r} is loaded (loaded: "
                               f"{', '.join(slots.index) or 'none'})")
    del slots.index[name]


def _max_file_bytes(model: nn.Module, rank: int, tp_size: int) -> int:
    """A bound on an adapter file's size: every projection adapted at `rank` in float32 (this
    rank's shapes times the ranks, more than the whole model's)."""
    weights = [module for module in model.modules() if isinstance(module, LoraWeights)]
    numel = sum((len(w.part_rows) * w.a.shape[-1] + w.b.shape[1]) * rank for w in weights)
    return 4 * numel * tp_size + FILE_SLACK_BYTES
