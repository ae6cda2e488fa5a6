"""torch.distributed point-to-point links: gloo on CPU, NCCL on CUDA, the same code.

One two-rank process group per (sender, receiver) direction, created lazily through a rendezvous
store the cluster provides (a `torch.distributed.TCPStore`), so workers join and leave without a
global `init_process_group` or restart. The sender is rank 0, the receiver rank 1. A worker that
restarts comes back under a new worker id, so its pairs get fresh groups.

Metadata travels on the host: over the same gloo group under its own tag on CPU, over a gloo
group of its own beside the NCCL one on CUDA. A failed NCCL operation aborts its communicator and
raises in `wait` (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set unless the user chose otherwise): it
fails that link's transfers, never the whole process with every decode on it.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from splitserve.transfer.link import Fabric, Link, TransferError

DATA_TAG, META_TAG = 0, 1


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
        self._pending: list[tuple[dist.Work, torch.Tensor, float]] = []  # (work, tensor kept alive, queued at)
        prefix = dist.PrefixStore(f"splitserve/kv/{sender}->{receiver}", store)
        try:
            self._group = _pair_group(prefix, self._rank, device, timeout)
            self._meta_group = self._group if device.type != "cuda" else \
                _pair_group(dist.PrefixStore("meta", prefix), self._rank, torch.device("cpu"), timeout)
        except RuntimeError as error:
            raise TransferError(self.peer, f"could not connect: {error}") from error

    def send(self, tensor: torch.Tensor) -> None:
        self._post_send(self._live(self._group), tensor.contiguous(), DATA_TAG)

    def send_meta(self, tensor: torch.Tensor) -> None:
        self._post_send(self._live(self._meta_group), tensor.contiguous(), META_TAG)

    def _post_send(self, group, tensor: torch.Tensor, tag: int) -> None:
        try:
            self._pending.append((group.send([tensor], self._other, tag), tensor, time.monotonic()))
        except RuntimeError as error:
            raise TransferError(self.peer, str(error)) from error
        self._reap()

    def _reap(self) -> None:
        """Drop sends that have left; a send that failed (dead peer) raises here."""
        for work, _, _ in self._pending:
            if work.is_completed() and work.exception() is not None:
                raise TransferError(self.peer, str(work.exception()).splitlines()[0])
        self._pending = [entry for entry in self._pending if not entry[0].is_completed()]

    def flush(self, timeout: float) -> None:
        pending, self._pending = self._pending, []
        for work, _, _ in pending:
            self._wait(work, timeout)

    def unsent(self, timeout: float) -> int:
        self._reap()
        if self._pending and time.monotonic() - self._pending[0][2] > timeout:
            raise TransferError(self.peer, f"a send has not left after {timeout} s (the peer stopped reading)")
        return len(self._pending)

    def recv(self, out: torch.Tensor, timeout: float) -> None:
        self._post_recv(self._live(self._group), out, DATA_TAG, timeout)

    def recv_meta(self, out: torch.Tensor, timeout: float) -> None:
        self._post_recv(self._live(self._meta_group), out, META_TAG, timeout)

    def _post_recv(self, group, out: torch.Tensor, tag: int, timeout: float) -> None:
        try:
            work = group.recv([out], self._other, tag)
        except RuntimeError as error:
            raise TransferError(self.peer, str(error)) from error
        self._wait(work, timeout)

    def close(self) -> None:
        self._pending.clear()
        self._group = self._meta_group = None

    def _live(self, group):
        if group is None:
            raise TransferError(self.peer, "the link is closed")
        return group

    def _wait(self, work: dist.Work, timeout: float) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as error:
            raise TransferError(self.peer, str(error).splitlines()[0]) from error


def _pair_group(store: dist.Store, rank: int, device: torch.device, timeout: float):
    """Blocks until both ranks have joined (gloo) or the first operation (NCCL)."""
    if device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicator, keep the process
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout))
