"""One worker's tensor-parallel ranks: the process groups they share and the messages between them.

A `TPGroup` is created per worker through a rendezvous store the cluster provides (a
`torch.distributed` Store under a prefix of the worker's own), never through the global process
group, so workers of any TP size come and go independently. Two channels:
- data: the model's all-reduces (NCCL on CUDA, gloo on CPU);
- control (gloo, on the host): rank 0 broadcasts each step's inputs and commands (pickled), and
  gathers the other ranks' reports. A rank waiting for the next step waits without a deadline
  (the leader may idle for hours); everything else waits at most `timeout`, so a dead or stuck
  rank fails the operation (`TPError`) instead of hanging it.
"""
from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist

IDLE_WAIT = datetime.timedelta(days=7)  # a follower waiting for the leader's next step
CONTROL_TAG = 7


class TPError(RuntimeError):
    """A collective between a worker's ranks failed (a rank died, stalled or disagreed)."""


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: float = 60.0):
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self.rank, self.size, self.timeout = rank, size, datetime.timedelta(seconds=timeout)
        try:
            self._control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, self.timeout)
            self._data = self._control if device.type != "cuda" else _nccl(dist.PrefixStore("data", store),
                                                                            rank, size, self.timeout)
        except RuntimeError as error:
            raise TPError(f"rank {rank} of {size} could not join its group: {error}") from error

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place, on the data channel; returns `tensor`."""
        return self._all_reduce(self._data, tensor, dist.ReduceOp.SUM)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (what all ranks can agree to, e.g. KV blocks)."""
        return int(self._all_reduce(self._control, torch.tensor([value]), dist.ReduceOp.MIN).item())

    def _all_reduce(self, group, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(group.allreduce([tensor], options))
        return tensor

    def broadcast(self, message: object = None) -> object:
        """Rank 0 sends `message` to every rank; each returns it. Other ranks wait for it without
        a deadline: between steps the leader may be idle for as long as it likes."""
        timeout = self.timeout if self.is_leader else IDLE_WAIT
        size = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.is_leader:
            payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            size[0] = payload.numel()
        self._broadcast(size, timeout)
        if not self.is_leader:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload, self.timeout)
        return message if self.is_leader else pickle.loads(payload.numpy().tobytes())

    def gather(self, message: object) -> list[object] | None:
        """Every rank's `message`, in rank order, at rank 0 (None elsewhere)."""
        if not self.is_leader:
            data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            self._wait(self._control.send([torch.tensor([data.numel()], dtype=torch.int64)], 0, CONTROL_TAG))
            self._wait(self._control.send([data], 0, CONTROL_TAG))
            return None
        found = [message]
        for rank in range(1, self.size):
            size = torch.empty(1, dtype=torch.int64)
            self._wait(self._control.recv([size], rank, CONTROL_TAG))
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self._wait(self._control.recv([data], rank, CONTROL_TAG))
            found.append(pickle.loads(data.numpy().tobytes()))
        return found

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, timeout
        self._wait(self._control.broadcast([tensor], options), timeout)

    def _wait(self, work: dist.Work, timeout: datetime.timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout)
        except RuntimeError as error:
            raise TPError(f"rank {self.rank} of {self.size}: {str(error).splitlines()[0]}") from error


def _nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicator, keep the process
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)
