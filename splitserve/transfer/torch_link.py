"""torch.distributed point-to-point links: gloo on CPU, NCCL on CUDA, the same code.

One two-rank process group per (sender, receiver) direction and link epoch, created lazily
through a rendezvous store the cluster provides (a `torch.distributed.TCPStore`), so workers join
and leave without a global `init_process_group` or restart. The sender is rank 0, the receiver
rank 1. A group's rendezvous keys cannot be met twice: a pair whose link failed meets again under
the next epoch, and a worker that restarts comes back under a new worker id.

Metadata travels on the host: over the same gloo group under its own tag on CPU, over a gloo
group of its own beside the NCCL one on CUDA. A failed NCCL operation aborts its communicator and
raises in `wait` (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set unless the user chose otherwise): it
fails that link's transfers, never the whole process with every decode on it.
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
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

    def link_to(self, peer: str, epoch: int = 0) -> Link:
        return TorchLink(self._pair_store(self.worker_id, peer, epoch), peer, True, self.device, self.timeout)

    def link_from(self, peer: str, epoch: int = 0) -> Link:
        return TorchLink(self._pair_store(peer, self.worker_id, epoch), peer, False, self.device, self.timeout)

    def retire(self, sender: str, receiver: str, epoch: int) -> None:
        self.store.set(self._retired_key(sender, receiver, epoch), b"1")

    def retired(self, sender: str, receiver: str, epoch: int) -> bool:
        return self.store.check([self._retired_key(sender, receiver, epoch)])

    def _pair_store(self, sender: str, receiver: str, epoch: int) -> dist.Store:
        """A group's rendezvous keys cannot be reused: each epoch of a pair meets under its own.
        Each link waits for its peer on a store connection of its own (a connection serves one
        call at a time), so links that meet at once, from several threads, never wait on each other."""
        return dist.PrefixStore(f"splitserve/kv/{sender}->{receiver}/{epoch}", self.store.clone())

    @staticmethod
    def _retired_key(sender: str, receiver: str, epoch: int) -> str:
        return f"splitserve/kv-retired/{sender}->{receiver}/{epoch}"


class _Send:
    """One send in flight. gloo finishes a send's work only inside `wait`, so a waiter thread
    waits on those (`finished` is set then); NCCL's work reports completion by itself."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, waited: bool):
        self.work, self.tensor, self.queued_at = work, tensor, time.monotonic()  # the tensor lives until it left
        self.finished = threading.Event() if waited else None
        self.error: str | None = None

    def left(self) -> bool:
        return self.finished.is_set() if self.finished else self.work.is_completed()

    def failure(self) -> str | None:
        if self.finished is None and self.work.is_completed() and self.work.exception() is not None:
            return str(self.work.exception()).splitlines()[0]
        return self.error


class _Waiter:
    """A thread that waits on gloo sends in their order, so the compute thread never does."""

    def __init__(self, peer: str, timeout: float):
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-send-{peer}")
        self._thread.start()

    def add(self, send: _Send) -> None:
        self._queue.put(send)

    def stop(self) -> None:
        """The sends queued before still get their wait: each one's work ends inside it."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        failed = None  # after a failed send the link is broken: later ones fail without a wait
        while (send := self._queue.get()) is not None:
            if failed is None:
                try:
                    send.work.wait(datetime.timedelta(seconds=self.timeout))
                except RuntimeError as error:
                    failed = str(error).splitlines()[0]
            send.error = failed
            send.finished.set()


class TorchLink(Link):
    def __init__(self, prefix: dist.Store, peer: str, is_sender: bool, device: torch.device, timeout: float):
        super().__init__(peer)
        self._rank, self._other = (0, 1) if is_sender else (1, 0)
        self._pending: list[_Send] = []
        self._waiter: _Waiter | None = None
        try:
            self._group = _pair_group(prefix, self._rank, device, timeout)
            self._meta_group = self._group if device.type != "cuda" else \
                _pair_group(dist.PrefixStore("meta", prefix), self._rank, torch.device("cpu"), timeout)
        except RuntimeError as error:
            raise TransferError(self.peer, f"could not connect: {error}") from error
        if is_sender:
            self._waiter = _Waiter(peer, timeout)

    def send(self, tensor: torch.Tensor) -> None:
        self._post_send(self._live(self._group), tensor.contiguous(), DATA_TAG)

    def send_meta(self, tensor: torch.Tensor) -> None:
        self._post_send(self._live(self._meta_group), tensor.contiguous(), META_TAG)

    def _post_send(self, group, tensor: torch.Tensor, tag: int) -> None:
        gloo = isinstance(group, dist.ProcessGroupGloo)
        try:
            send = _Send(group.send([tensor], self._other, tag), tensor, waited=gloo)
        except RuntimeError as error:
            raise TransferError(self.peer, str(error)) from error
        self._pending.append(send)
        if gloo:
            self._waiter.add(send)
        self._reap()

    def _reap(self) -> None:
        """Drop sends that have left; a send that failed (dead peer) raises here."""
        for send in self._pending:
            if send.left() and send.failure() is not None:
                raise TransferError(self.peer, send.failure())
        self._pending = [send for send in self._pending if not send.left()]

    def flush(self, timeout: float) -> None:
        pending, self._pending = self._pending, []
        for send in pending:
            if send.finished is None:
                self._wait(send.work, timeout)
            elif not send.finished.wait(timeout):
                raise TransferError(self.peer, f"a send has not left after {timeout} s (the peer stopped reading)")
            elif send.error is not None:
                raise TransferError(self.peer, send.error)

    def unsent(self, timeout: float) -> int:
        self._reap()
        if self._pending and time.monotonic() - self._pending[0].queued_at > timeout:
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
        if self._waiter is not None:
            self._waiter.stop()

    def join(self, timeout: float) -> None:
        if self._waiter is not None:
            self._waiter.join(timeout)

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
