"""torch.distributed point-to-point links: gloo on CPU, NCCL on CUDA, the same code.

One two-rank process group per (sender, receiver) direction, created lazily through a rendezvous
store the cluster provides (a `torch.distributed.TCPStore`), so workers join and leave without a
global `init_process_group` or restart. The sender is rank 0, the receiver rank 1. A worker that
restarts comes back under a new worker id, so its pairs get fresh groups.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from splitserve.transfer.link import Fabric, Link, TransferError


class TorchFabric(Fabric):
    """Links over torch.distributed pair groups that meet through `store`."""

    def __init__(self, store: dist.Store, worker_id: str, device: torch.device, timeout: float = 60.0):
        self.store, self.worker_id, self.device, self.timeout = store, worker_id, device, timeout

    @classmethod
    def join(cls, host: str, port: int, worker_id: str, device: torch.device, timeout: float = 60.0) -> "TorchFabric":
        """Connect to the cluster's rendezvous store (a TCPStore served at host:port)."""
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        return cls(store, worker_id, device, timeout)

    def link_to(self, peer: str) -> Link:
        return TorchLink(self.store, self.worker_id, peer, True, self.device, self.timeout)

    def link_from(self, peer: str) -> Link:
        return TorchLink(self.store, peer, self.worker_id, False, self.device, self.timeout)


class TorchLink(Link):
    def __init__(self, store: dist.Store, sender: str, receiver: str, is_sender: bool,
                 device: torch.device, timeout: float):
        super().__init__(receiver if is_sender else sender)
        self._rank, self._other = (0, 1) if is_sender else (1, 0)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        prefix = dist.PrefixStore(f"splitserve/kv/{sender}->{receiver}", store)
        try:
            self._group = _pair_group(prefix, self._rank, device, timeout)
        except RuntimeError as error:
            raise TransferError(self.peer, f"could not connect: {error}") from error

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        try:
            self._pending.append((self._live().send([tensor], self._other, 0), tensor))
        except RuntimeError as error:
            raise TransferError(self.peer, str(error)) from error
        self._reap()

    def _reap(self) -> None:
        """Drop sends that have left; a send that failed (dead peer) raises here."""
        for work, _ in self._pending:
            if work.is_completed() and work.exception() is not None:
                raise TransferError(self.peer, str(work.exception()).splitlines()[0])
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def flush(self, timeout: float) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work, timeout)

    def recv(self, out: torch.Tensor, timeout: float) -> None:
        try:
            work = self._live().recv([out], self._other, 0)
        except RuntimeError as error:
            raise TransferError(self.peer, str(error)) from error
        self._wait(work, timeout)

    def close(self) -> None:
        self._pending.clear()
        self._group = None

    def _live(self):
        if self._group is None:
            raise TransferError(self.peer, "the link is closed")
        return self._group

    def _wait(self, work: dist.Work, timeout: float) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as error:
            raise TransferError(self.peer, str(error).splitlines()[0]) from error


def _pair_group(store: dist.Store, rank: int, device: torch.device, timeout: float):
    """Blocks until both ranks have joined (gloo) or the first operation (NCCL)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout))
