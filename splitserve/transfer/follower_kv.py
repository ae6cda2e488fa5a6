"""KV transfers on a tensor-parallel worker's ranks other than 0: each rank pushes and receives its
own KV heads over a transport of its own, as the leader's commands say, and reports what finished."""
from __future__ import annotations

import torch

from splitserve.engine.tp_step import TPFollower
from splitserve.transfer.codec import Slots
from splitserve.transfer.link import TransferError
from splitserve.transfer.rank_commands import (Abandon, CancelExport, Expect, FinishExport, ForgetPeers, PushLayers,
                                               RankReport)
from splitserve.transfer.rank_kv import RankKV
from splitserve.transfer.transport import KVTransport


class FollowerKV:
    def __init__(self, follower: TPFollower, transport: KVTransport):
        self.rank = RankKV(transport, follower.kv_cache, follower.model_config.num_key_value_heads)
        self.transport, self._device = transport, follower.kv_cache.data.device
        self._layer_parts: list[tuple] = []
        self._report = RankReport()
        follower.on_command, follower.after_layer, follower.report = self.on_command, self.after_layer, self.report

    def on_command(self, command) -> None:
        if isinstance(command, PushLayers):
            self._layer_parts = [(part, self._slots(slots), span) for part, slots, span in command.parts]
        elif isinstance(command, FinishExport):
            self._try(command.part, lambda: self._finish(command))
        elif isinstance(command, CancelExport):
            self._try(command.part, lambda: self.transport.release(command.part))
        elif isinstance(command, Expect):
            self._report.stamped.append(self.rank.expect(command.part, self._slots(command.slots, torch.device("cpu")),
                                                         command.blocks))
        elif isinstance(command, Abandon):
            if self.transport.abandon(command.part) and command.part.dest is not None:
                self._report.released.append(command.part)
        elif isinstance(command, ForgetPeers):
            self.transport.forget_peers(command.peers)
        else:
            raise TypeError(f"unknown KV command {command!r}")

    def after_layer(self, layer: int) -> None:
        for part, slots, span in self._layer_parts:
            self._try(part, lambda: self.rank.push_layer(part, layer, slots, span))

    def report(self) -> RankReport:
        """What finished since the last round; pushes whose link broke fail their transfer on the
        token side too, so only the ones that raised here are reported."""
        self._layer_parts = []
        self.transport.reap()
        report, self._report = self._report, RankReport()
        report.landed.extend(self.transport.poll())
        report.released.extend(self.transport.take_released())
        return report

    def _finish(self, command: FinishExport) -> None:
        if not command.part.layerwise:
            self.rank.push_all(command.part, self._slots(command.slots))
        self.transport.complete(command.part, 0)  # the first token travels on part (0 -> 0)

    def _try(self, part, push) -> None:
        try:
            push()
        except TransferError as error:
            self._report.push_failures.append((part, error))

    def _slots(self, slots: list[list[int]], device: torch.device | None = None) -> Slots:
        return tuple(torch.tensor(group, dtype=torch.long, device=device or self._device) for group in slots)
