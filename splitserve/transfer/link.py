"""The backend interface: an ordered, one-way channel of tensors from one worker to one peer.

Semantics every backend keeps:
- `send` is asynchronous and keeps the tensor alive until it is on the wire; messages arrive in
  the order they were sent (the protocol above relies on order, not tags, so NCCL works too);
- `send_meta` / `recv_meta` carry small CPU tensors (headers, the first token) in their own
  order, on a host channel where the backend has one (gloo beside NCCL): reading a header never
  waits for the device. A header is always sent before the payload it announces;
- `recv` fills a tensor of the expected shape and dtype, and waits at most `timeout` seconds;
- `unsent(timeout)` counts sends that have not left, without waiting;
- every failure (dead peer, timeout, closed channel) raises `TransferError` naming the peer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class TransferError(RuntimeError):
    """A KV transfer failed; `peer` names the worker at the other end."""

    def __init__(self, peer: str, message: str):
        super().__init__(f"KV transfer with peer {peer!r} failed: {message}")
        self.peer, self.detail = peer, message

    def __reduce__(self):  # pickles (a rank's report to its leader) as a plain TransferError
        return TransferError, (self.peer, self.detail)


class Link(ABC):
    def __init__(self, peer: str):
        self.peer = peer

    @abstractmethod
    def send(self, tensor: torch.Tensor) -> None:
        """Queue `tensor` for the peer (asynchronous)."""

    def send_meta(self, tensor: torch.Tensor) -> None:
        """Queue a small CPU tensor of metadata (default: on the data path, in its order)."""
        self.send(tensor)

    def recv_meta(self, out: torch.Tensor, timeout: float) -> None:
        """Receive the next metadata message into the CPU tensor `out`."""
        self.recv(out, timeout)

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Wait until every queued send has left; raises TransferError."""

    @abstractmethod
    def unsent(self, timeout: float) -> int:
        """Sends queued and not yet left, without waiting; raises TransferError if one failed, or
        if the oldest has waited longer than `timeout` (a peer that stopped reading)."""

    @abstractmethod
    def recv(self, out: torch.Tensor, timeout: float) -> None:
        """Receive the next message into `out`; raises TransferError."""

    @abstractmethod
    def close(self) -> None:
        """Release the channel; later calls raise TransferError."""


class Fabric(ABC):
    """Makes one worker's links to its peers, for one backend. A pair's link has an epoch: after
    a failure the pair meets again under the next one (a backend whose rendezvous cannot be
    reused keys it by epoch; one that reconnects freely ignores it)."""

    worker_id: str  # the worker whose links these are

    @abstractmethod
    def link_to(self, peer: str, epoch: int = 0) -> Link:
        """A link this worker sends on (prompt side)."""

    @abstractmethod
    def link_from(self, peer: str, epoch: int = 0) -> Link:
        """A link this worker receives on (token side)."""

    def retire(self, sender: str, receiver: str, epoch: int) -> None:
        """The receiver gave the epoch up: a sender must not wait to meet it there."""

    def retired(self, sender: str, receiver: str, epoch: int) -> bool:
        return False
