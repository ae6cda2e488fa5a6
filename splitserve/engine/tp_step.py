"""How a tensor-parallel worker's ranks step together.

Rank 0 (the leader) runs the whole engine: scheduler, block manager, sampler. Every step is a
round: the leader broadcasts a `Round` (commands for the other ranks, then the step's batch), all
ranks run the batch on their shards (the model's all-reduces pair them up), and the leader
gathers one report per other rank. Commands and reports are opaque here: the KV transfer layer
posts commands (push these layers, expect that import) and reads the reports (what landed); the
engine's own commands (`lora_loading`'s: a LoRA adapter loaded, swapped into a slot, let go) are
run here.
A round without a batch (`sync`) only carries commands and reports.

A failed round leaves the ranks out of step (a rank may sit in an all-reduce the others never
reach), so the leader marks itself broken and its engine fails its integrity check: the worker
is replaced, never stepped again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.host_kv_blocks import HostKVCopy
from splitserve.engine.lora_loading import DropAdapters, StoreAdapter, WriteSlot
from splitserve.engine.model_runner import ModelRunner, StepBatch
from splitserve.engine.shard_builder import build_shard
from splitserve.engine.tensor_parallel import TPGroup


@dataclass(frozen=True)
class Round:
    commands: list = field(default_factory=list)  # per rank: commands[rank - 1] is a list for that rank
    batch: StepBatch | None = None
    stop: bool = False


class TPLeader:
    """The leader's side of every round (the model runner's `StepChannel`)."""

    def __init__(self, group: TPGroup):
        self.group = group
        self.broken: str | None = None
        self.rounds = 0  # rounds completed: a reader of reports can tell whether one ran since it looked
        self.listeners: list[Callable[[list], None]] = []  # each gets the other ranks' reports, in rank order
        self._commands: list[list] = [[] for _ in range(group.size - 1)]

    def post(self, rank: int, command: object) -> None:
        """Queue a command for `rank` (>= 1); it goes out with the next round."""
        self._commands[rank - 1].append(command)

    def post_all(self, command: object) -> None:
        """Queue `command` for every other rank."""
        for rank in range(1, self.group.size):
            self.post(rank, command)

    @property
    def has_commands(self) -> bool:
        return any(self._commands)

    def begin(self, batch: StepBatch | None) -> None:
        commands, self._commands = self._commands, [[] for _ in range(self.group.size - 1)]
        self._guard(lambda: self.group.broadcast(Round(commands, batch)))

    def end(self) -> None:
        reports = self._guard(lambda: self.group.gather(None))[1:]
        self.rounds += 1
        for listener in self.listeners:
            listener(reports)

    def abandon(self, error: BaseException) -> None:
        """The leader's own part of a round failed after `begin`: the ranks are out of step."""
        self.broken = self.broken or f"a tensor-parallel step failed mid-round: {type(error).__name__}: {error}"

    def sync(self) -> None:
        """A round without a batch: commands out, reports back."""
        self.begin(None)
        self.end()

    def stop(self) -> None:
        """Ask the other ranks to leave their loop."""
        if self.broken is None:
            self._guard(lambda: self.group.broadcast(Round(stop=True)))

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel group of {self.group.size} ranks is broken: {self.broken}")

    def _guard(self, fn):
        self.check()
        try:
            return fn()
        except Exception as error:
            self.abandon(error)
            raise


class TPFollower:
    """A rank > 0: its shard of the model and of the KV cache, stepping as the leader says.
    `on_command(command)`, `after_layer(layer)` and `report()` are the KV transfer layer's hooks."""

    def __init__(self, model: str, config: EngineConfig, group: TPGroup):
        self.group, self.model_name, self.config = group, model, config
        shard = build_shard(model, config, group)
        self.model_config, self.kv_cache, self.max_model_len = shard.model_config, shard.kv_cache, shard.max_model_len
        self.runner: ModelRunner = shard.runner
        self.host_kv = shard.host_kv
        self.on_command: Callable[[object], None] | None = None
        self.after_layer: Callable[[int], None] | None = None
        self.report: Callable[[], object] | None = None

    def serve(self) -> None:
        """Step with the leader until it says stop (returns) or a round fails (raises TPError)."""
        while True:
            round_ = self.group.broadcast()
            if round_.stop:
                return
            for command in round_.commands[self.group.rank - 1]:
                if isinstance(command, (StoreAdapter, WriteSlot, DropAdapters)):  # the engine's own (LoRA adapters)
                    command.apply(self.runner.model)
                elif isinstance(command, HostKVCopy):  # the engine's own (the host KV tier)
                    command.apply(self.host_kv)
                else:
                    self.on_command(command)
            if round_.batch is not None:
                with torch.inference_mode():
                    self.runner.forward(round_.batch, self.after_layer)
            self.group.gather(self.report() if self.report is not None else None)
