"""LoRA adapters in the decoder's projections, several in one step: each token runs under its
sequence's adapter, or none.

`LoraSlots` (one per model) holds the adapters by slot: which adapter each slot holds (its
identity, what its prefix-cache blocks chain from), the adapters held in host memory
(`lora_store`), and which of a step's token rows run under which slot; the runner sets the rows
before every forward.
Each adapted projection holds `LoraWeights`: every slot's A stacked [slots, parts * rank, in] and B
[slots, out, rank], a merged projection's parts each with their own rows of both. A part an
adapter leaves alone, and the ranks past a smaller adapter's, hold zeros. An eager step adds, per
slot in it, B @ (A @ x) to its tokens' rows; a captured decode step (`cuda_graphs`) reads each
row's slot from a device tensor instead (`LoraSlots.rows`: Triton kernels on CUDA, `add_rows_torch`
elsewhere), so its launches do not depend on which adapters run.

A sequence is bound to a slot holding its adapter when admitted (`lora_residency`), and a slot
no sequence is bound to may take another adapter from host memory (`pack_adapter`, `write_packed`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.engine.config import ConfigError
from splitserve.engine.lora_store import HostAdapters, PackedAdapter
from splitserve.engine.model import triton_dispatch
from splitserve.engine.model.linear import Linear, MergedLinear, RowParallelLinear
from splitserve.engine.model.sharding import ShardSlice
from splitserve.engine.step_inputs import upload_list

if TYPE_CHECKING:
    from splitserve.engine.lora_adapter import LoraAdapter

NO_ADAPTER = -1  # a sequence's slot when it runs on the base model


class LoraSlots:
    """`capacity` slots of adapters of rank at most `rank`, and `host_capacity` adapters in host
    memory (`host`; default: as many as slots). `at_run_time`: adapters may be loaded while
    serving (every projection holds slots)."""

    def __init__(self, capacity: int = 0, rank: int = 0, at_run_time: bool = False, host_capacity: int | None = None):
        self.capacity, self.rank, self.at_run_time = capacity, rank, at_run_time
        self.host = HostAdapters(capacity if host_capacity is None else host_capacity)
        self.identity: list[str | None] = [None] * capacity  # per slot: its adapter's identity; None: empty
        self.groups: list[tuple[int, slice | torch.Tensor]] = []  # (slot, its token rows), slots in the step
        self.rows: torch.Tensor | None = None  # set: each row's slot [T] (-1: none), read on the device

    def set(self, adapters: Sequence[int], query_starts: Sequence[int], device: torch.device) -> None:
        """`adapters`: each sequence's slot in the step's order (empty: none runs under one),
        `query_starts` where each sequence's rows start."""
        self.groups = []
        if not adapters:  # a model without adapters: nothing to group, every step
            return
        spans: dict[int, list[int]] = {}
        for seq, slot in enumerate(adapters):
            if slot != NO_ADAPTER:
                spans.setdefault(slot, []).extend(range(query_starts[seq], query_starts[seq + 1]))
        self.groups = [(slot, _row_index(rows, device)) for slot, rows in spans.items()]


def _row_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice where the rows are one run (a step of one adapter's sequences), else an index
    uploaded without waiting for the device."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return upload_list(rows, torch.long, device)


class LoraWeights(nn.Module):
    """One projection's adapters (buffers: no checkpoint names them, the loader never fills them).
    `live`: the slots whose adapter adapts this projection (a step skips the others' zeros)."""

    def __init__(self, slots: LoraSlots, a: torch.Tensor, b: torch.Tensor, part_rows: Sequence[int]):
        super().__init__()
        self.slots, self.rank, self.part_rows = slots, b.shape[-1], list(part_rows)
        self.live: set[int] = set()
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)

    def write(self, slot: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """`slot`'s A and B from the host (in order on the device's stream); None: zeros, not adapted."""
        if ab is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.live.discard(slot)
            return
        self.a[slot].copy_(ab[0], non_blocking=True)
        self.b[slot].copy_(ab[1], non_blocking=True)
        self.live.add(slot)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (x's projection [T, out]) with each adapter's product added to its rows, in place."""
        by_row = self.slots.rows
        if by_row is not None:
            if triton_dispatch.runs_kernels(x):
                return triton_dispatch.lora_ops().add_rows(x, out, self.a, self.b, by_row, self.part_rows)
            return add_rows_torch(x, out, self.a, self.b, by_row, self.part_rows)
        r = self.rank
        for slot, rows in self.slots.groups:
            if slot not in self.live:
                continue
            xa = x[rows] @ self.a[slot].T  # [t, parts * r]
            b, deltas, start = self.b[slot], [], 0
            for part, size in enumerate(self.part_rows):
                deltas.append(xa[:, part * r:(part + 1) * r] @ b[start:start + size].T)
                start += size
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


def add_rows_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   part_rows: Sequence[int]) -> torch.Tensor:
    """`triton_lora.add_rows` in torch (float32 products, as the kernels), gathering each row's A
    and B: a captured step's path without CUDA, and the kernels' oracle."""
    rank, live = b.shape[-1], row_slots >= 0
    slots = row_slots.clamp(min=0)
    xa = torch.einsum("tk,trk->tr", x.float(), a[slots].float())  # [T, parts * rank]
    deltas, start = [], 0
    for part, size in enumerate(part_rows):
        deltas.append(torch.einsum("tj,tnj->tn", xa[:, part * rank:(part + 1) * rank],
                                   b[slots, start:start + size].float()))
        start += size
    out.copy_(out.float() + torch.cat(deltas, dim=-1) * live[:, None])
    return out


def attach_adapters(model: nn.Module, slots: LoraSlots, adapters: Sequence[LoraAdapter], dtype: torch.dtype,
                    device: torch.device, every_projection: bool = False) -> None:
    """Give `slots.capacity` slots of `LoraWeights` (in the serving `dtype`) to each projection some
    adapter adapts, or with `every_projection` to every one an adapter may (adapters loaded later),
    hold `adapters` in host memory and write the first into the slots; after the base weights are
    loaded."""
    targets = _adaptable(model)
    for adapter in adapters:
        _check_targets(adapter, targets)
    if every_projection:
        linears = {linear for linear, _ in targets.values()}
    else:
        linears = {targets[module][0] for adapter in adapters for module in adapter.weights}
    for linear in linears:
        parts = list(linear.parts.values()) if isinstance(linear, MergedLinear) else [linear.out_features]
        a = torch.zeros(slots.capacity, len(parts) * slots.rank, linear.in_features, device=device, dtype=dtype)
        b = torch.zeros(slots.capacity, linear.out_features, slots.rank, device=device, dtype=dtype)
        linear.lora = LoraWeights(slots, a, b, parts)
    for adapter in adapters:
        slots.host.add(pack_adapter(model, slots, adapter))
    for slot, identity in enumerate(list(slots.host.names.values())[:slots.capacity]):
        write_packed(model, slot, slots.host.adapters[identity])


def write_packed(model: nn.Module, slot: int, adapter: PackedAdapter) -> None:
    """A packed adapter into `slot` of every projection holding slots, which then names its identity."""
    slots: LoraSlots = model.lora_slots
    slots.identity[slot] = None  # a slot being written holds no adapter, whatever the write leaves in it
    for weights, ab in adapter.weights.items():
        weights.write(slot, ab)
    slots.identity[slot] = adapter.identity


def pack_adapter(model: nn.Module, slots: LoraSlots, adapter: LoraAdapter) -> PackedAdapter:
    """`adapter` as this rank's slots hold it, on the host in their dtype (None for a projection
    it leaves alone); a projection the model lacks or an adapter shaped unlike it is a ConfigError
    naming the adapter and the projection, as is a rank past the slots'."""
    if adapter.rank > slots.rank:
        raise ConfigError(f"lora: adapter {adapter.name!r} has rank {adapter.rank}, past max_lora_rank "
                          f"{slots.rank}")
    targets = _adaptable(model)
    _check_targets(adapter, targets)
    modules_of: dict[Linear, list[tuple[str, int | None]]] = {}
    for module, (linear, part) in targets.items():
        modules_of.setdefault(linear, []).append((module, part))
    packed = {}
    for linear, modules in modules_of.items():
        if linear.lora is None:
            continue
        lora, ab = linear.lora, None
        adapted = [(module, part) for module, part in modules if module in adapter.weights]
        if adapted:
            a, b = torch.zeros(lora.a.shape[1:]), torch.zeros(lora.b.shape[1:])
            for module, part in adapted:
                _fill(a, b, adapter, module, linear, part)
            ab = tuple(HostAdapters.host(t.to(lora.a.dtype), lora.a.device) for t in (a, b))
        packed[lora] = ab
    return PackedAdapter(adapter.name, adapter.identity, packed)


@contextlib.contextmanager
def every_slot_live(model: nn.Module):
    """Inside, every projection holding adapters computes slot 0's product, loaded or not (the
    memory profile's largest step, before any adapter is loaded at run time)."""
    weights = [module for module in model.modules() if isinstance(module, LoraWeights)]
    kept = [set(w.live) for w in weights]
    for w in weights:
        w.live.add(0)
    try:
        yield
    finally:
        for w, live in zip(weights, kept):
            w.live = live


def _check_targets(adapter: LoraAdapter, targets: dict[str, tuple[Linear, int | None]]) -> None:
    for module in adapter.weights:
        if module not in targets:
            raise ConfigError(f"lora: adapter {adapter.name!r} adapts {module}, which is not one of this model's "
                              "dense projections (attention's q, k, v, o; a dense MLP's gate, up, down)")


def _fill(a: torch.Tensor, b: torch.Tensor, adapter: LoraAdapter, module: str, linear: Linear,
          part: int | None) -> None:
    """One adapted module's A and B into this rank's rows of its projection; `part` None: the
    checkpoint's fused projection (Phi-3's qkv_proj), every part taking A and its rows of B. With
    tensor parallelism a column-parallel part keeps its rows of B (A whole, as its input is), a
    row-parallel projection its columns of A (B whole: the all-reduce sums the ranks' products)."""
    lora_a, lora_b = adapter.weights[module]
    parts = _part_rows(linear)
    cols = linear.shard_slice if isinstance(linear, RowParallelLinear) else None  # this rank's input columns
    full_in = linear.in_features if cols is None else cols.total
    full_out = sum(total for total, _ in parts) if part is None else parts[part][0]
    if lora_a.shape[1] != full_in or lora_b.shape[0] != full_out:
        raise ConfigError(f"lora_modules: adapter {adapter.name!r}: {module}'s A {tuple(lora_a.shape)} and B "
                          f"{tuple(lora_b.shape)} do not fit the model's [{full_out}, {full_in}] projection")
    rank, width = lora_a.shape[0], b.shape[-1]
    lora_a = lora_a if cols is None else cols.take(lora_a)
    start, full_start = 0, 0  # where part p's rows begin on this rank, and in the checkpoint
    for p, (total, rows) in enumerate(parts):
        here = total if rows is None else rows.stop - rows.start
        if part is None or part == p:
            full_b = lora_b[full_start:full_start + total] if part is None else lora_b
            a[p * width:p * width + rank] = lora_a
            b[start:start + here, :rank] = full_b if rows is None else rows.take(full_b)
        start, full_start = start + here, full_start + total


def _part_rows(linear: Linear) -> list[tuple[int, ShardSlice | None]]:
    """Each part's rows in the checkpoint and, with tensor parallelism, the slice of them this rank holds."""
    if not isinstance(linear, MergedLinear):
        return [(linear.out_features, None)]
    return [(linear.slices[name].total, linear.slices[name]) if name in linear.slices else (rows, None)
            for name, rows in linear.parts.items()]


def _adaptable(model: nn.Module) -> dict[str, tuple[Linear, int | None]]:
    """Checkpoint module name -> (projection, its part; None: all of a merged one's)."""
    found: dict[str, tuple[Linear, int | None]] = {}
    for owner, module in model.named_modules():
        if isinstance(module, MergedLinear):
            prefix = owner.rpartition(".")[0]
            found.update((f"{prefix}.{name}", (module, p)) for p, name in enumerate(module.parts))
            found[owner] = (module, None)
        elif isinstance(module, RowParallelLinear):
            found[owner] = (module, None)
    return found
