"""The host tier's memory on one rank (`host_kv_tier`'s `BlockMover`): slots of host memory, each
holding one KV block of every layer of its group, laid out slot by slot so a slot is one contiguous
copy. Pinned on CUDA, where saves and loads are queued on the current stream: a save is ordered
after the forward that wrote the block and before any later one that writes it again, a restore
before any that reads it. A write-through `write` runs on a side stream after everything queued
so far, overlapping the next forwards; `fence` makes the current stream wait for the writes. Another
stream (a KV import's) is ordered by `wait`, which the engine calls before it hands a reservation
out. With tensor parallelism each rank keeps its heads' part of every slot: the leader's copies,
fences and waits go to the other ranks as `HostKVCopy` commands, run in order before the round's
batch and, for a KV import's reservation, before the import's own commands.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_memory_check import free_bytes

STAGED_BLOCKS = 64  # blocks a copy gathers on the device at once (Llama-3-8B's, bf16: 128 MiB)

if TYPE_CHECKING:
    from splitserve.engine.tp_step import TPLeader


class HostKVBlocks:
    def __init__(self, kv_cache: KVCache, num_slots: int):
        """`num_slots` blocks, which the host must have free (a ConfigError otherwise)."""
        data = kv_cache.data
        self.data, self.cuda = data, data.device.type == "cuda"
        shape = (num_slots, data.shape[0], data.shape[1], *data.shape[3:])  # [slot, layer of group, K/V, ...]
        size, free = num_slots * kv_cache.block_bytes, free_bytes(torch.device("cpu"))
        if free is not None and size > free:
            raise ConfigError(f"kv_host_cache_bytes asks for {num_slots} KV blocks = {size} bytes of host memory, "
                              f"but the host has {free} bytes free")
        self.host = torch.empty(shape, dtype=data.dtype, pin_memory=self.cuda)  # a slot is read once saved
        self._saved = torch.cuda.Event() if self.cuda else None    # the last save, on the current stream
        self._written = torch.cuda.Event() if self.cuda else None  # the last write, on the side stream
        self._side = torch.cuda.Stream(data.device) if self.cuda else None
        self._unwaited: set[torch.cuda.Event] = set()  # queued since the last wait

    @staticmethod
    def num_slots(kv_cache: KVCache, budget_bytes: int) -> int:
        """The slots `budget_bytes` of host memory hold; a ConfigError where that is none."""
        block = kv_cache.block_bytes
        if budget_bytes < block:
            raise ConfigError(f"kv_host_cache_bytes={budget_bytes} holds no KV block (one takes {block} bytes)")
        return budget_bytes // block

    def save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        self._copy_out(block_ids, slots, self._saved)

    def write(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        if not self.cuda:
            self.save(block_ids, slots)
            return
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            self._copy_out(block_ids, slots, self._written)

    def fence(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._written)

    def _copy_out(self, block_ids: Seq[int], slots: Seq[int], done: torch.cuda.Event | None) -> None:
        for i in range(0, len(block_ids), STAGED_BLOCKS):
            self._save(block_ids[i:i + STAGED_BLOCKS], slots[i:i + STAGED_BLOCKS])
        if self.cuda:
            done.record()
            self._unwaited.add(done)

    def load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        for i in range(0, len(block_ids), STAGED_BLOCKS):
            self._load(slots[i:i + STAGED_BLOCKS], block_ids[i:i + STAGED_BLOCKS])

    def _save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        ids = torch.tensor(block_ids, device=self.data.device)
        blocks = self.data.index_select(2, ids).movedim(2, 0)
        if not self.cuda:
            self.host[torch.tensor(slots)] = blocks
            return
        blocks = blocks.contiguous()
        for first, start, count in _runs(slots):
            self.host[start:start + count].copy_(blocks[first:first + count], non_blocking=True)

    def _load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        ids = torch.tensor(block_ids, device=self.data.device)
        if not self.cuda:
            self.data[:, :, ids] = self.host[torch.tensor(slots)].movedim(0, 2)
            return
        blocks = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype, device=self.data.device)
        for first, start, count in _runs(slots):
            blocks[first:first + count].copy_(self.host[start:start + count], non_blocking=True)
        self.data[:, :, ids] = blocks.movedim(0, 2)

    def wait(self) -> None:
        """Until every save and write queued so far has read its blocks (on CPU they are done on return)."""
        for event in self._unwaited:
            event.synchronize()
        self._unwaited.clear()


@dataclass(frozen=True)
class HostKVCopy:
    """A tensor-parallel rank's part of the host tier's work: `kind` is a `HostKVBlocks` method
    (save, write, load: device blocks into slots or back; fence; wait)."""

    kind: str
    block_ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()

    def apply(self, blocks: HostKVBlocks) -> None:
        if self.kind == "load":
            blocks.load(self.slots, self.block_ids)
        elif self.kind in ("save", "write"):
            getattr(blocks, self.kind)(self.block_ids, self.slots)
        else:
            getattr(blocks, self.kind)()


class LeaderHostKV:
    """The leader's mover: its own copies, and the other ranks' as commands with the next round."""

    def __init__(self, own: HostKVBlocks, leader: TPLeader):
        self.own, self.leader = own, leader

    def save(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        self.own.save(block_ids, slots)
        self.leader.post_all(HostKVCopy("save", tuple(block_ids), tuple(slots)))

    def write(self, block_ids: Seq[int], slots: Seq[int]) -> None:
        self.own.write(block_ids, slots)
        self.leader.post_all(HostKVCopy("write", tuple(block_ids), tuple(slots)))

    def load(self, slots: Seq[int], block_ids: Seq[int]) -> None:
        self.own.load(slots, block_ids)
        self.leader.post_all(HostKVCopy("load", tuple(block_ids), tuple(slots)))

    def fence(self) -> None:
        self.own.fence()
        self.leader.post_all(HostKVCopy("fence"))

    def wait(self) -> None:
        """The leader's own saves and writes; every other rank's before it runs an import's commands."""
        self.own.wait()
        self.leader.post_all(HostKVCopy("wait"))


def _runs(slots: Seq[int]) -> list[tuple[int, int, int]]:
    """(index into `slots`, first slot, length) of each run of consecutive slots."""
    runs = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs
