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

A direct link (`direct`: two workers that share memory, `direct_link.py`) carries metadata only:
the sender writes KV straight into the receiver's cache (`write`), `seal`s before a transfer's
last message, and the receiver `fence`s when it reads that message.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitserve.engine.kv_cache import KVCache
    from splitserve.transfer.codec import Slots


class TransferError(RuntimeError):
    """A KV transfer failed; `peer` names the worker at the other end."""

    def __init__(self, peer: str, message: str):
        super().__init__(f"KV transfer with peer {peer!r} failed: {message}")
        self.peer, self.detail = peer, message

    def __reduce__(self):  # pickles (a rank's report to its leader) as a plain TransferError
        return TransferError, (self.peer, self.detail)


class Link(ABC):
    direct = False  # True: KV is written into the receiver's cache by `write`, never sent

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

    def join(self, timeout: float) -> None:
        """After `close`: waits up to `timeout` for the threads the link still runs. A process
        that exits while one of them is inside torch aborts (std::terminate)."""

    def write(self, source: KVCache, source_slots: Slots, layers: slice, source_heads: slice | None,
              dest, starts: tuple[int, ...], num_tokens: int) -> int:
        """Direct links: write the KV at `source_slots` (codec.Slots: per layer group) of `source`
        (this rank's cache) for `layers` into the receiver's cache, where `dest` (a
        transport.CacheDest) holds positions starts[group] .. num_tokens-1 of each group's; returns
        the bytes written."""
        raise TransferError(self.peer, "this link sends KV; it cannot write into the peer's cache")

    def seal(self) -> None:
        """Direct links, sender: every `write` so far is ordered before the next metadata message,
        and this process's compute after them (the source blocks may be freed then)."""

    def fence(self) -> None:
        """Direct links, receiver: work on the current stream is ordered after every write the
        sender sealed before the metadata read last."""


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

    def direct(self, peer: str) -> bool:
        """Receiver: whether `peer` can write KV straight into this worker's cache."""
        return False

    def claim(self, receiver: str, tag: int, deadline: float) -> bool:
        """Sender of a direct transfer, before its first write: whether it may write into the
        receiver's blocks (False: the receiver gave the transfer up first, or `deadline`, a
        time.monotonic() of this node, has passed). The receiver holds the blocks for a claimed
        transfer until the sender's last message for it."""
        return True

    def give_up(self, tag: int, deadline: float) -> bool:
        """Receiver: give a direct transfer up; True when its sender had not claimed it, and
        never will (no claim succeeds after `deadline`), so its blocks may be freed now."""
        return True

    def settle(self, tag: int) -> None:
        """Receiver: a claimed direct transfer is over; its claim can go."""

    def direct_link_to(self, peer: str, epoch: int = 0) -> Link:
        """A direct link to `peer` (the ticket says the peer's cache is open to this worker)."""
        raise TransferError(peer, f"worker {self.worker_id!r} cannot write into another worker's cache "
                                  "(its transfer backend shares no memory)")
