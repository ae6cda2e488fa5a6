"""The token side of `KVTransport`: the transfers a token rank expects, one receive loop per
(prompt peer, link epoch) that checks each message and writes its KV into the reserved blocks, and
the finished transfers `poll` hands back.

Invariants:
- A loop reads its link until the link fails, including the messages of abandoned transfers
  (dropped), so a sender never waits on a reader that stopped.
- A link's failure retires its epoch and fails every transfer still waiting on it; a silent peer
  fails only the transfers waiting on it (`poll`), never the link.
- Nothing is allocated for a payload larger than what its reservation has left (`_check_size`),
  and nothing is written for a transfer once `abandon` returned (writes happen under the lock).
- A layer lands in pieces, each where the layer's last one ended (`_Incoming.cursors`); a
  transfer completes only once every layer has landed whole.
- A direct transfer's blocks are freed only once its sender cannot write into them any more
  (`DirectWrites`); so a direct link that broke the protocol is read on until its sender closes it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from splitserve.transfer.codec import Slots, split_layers
from splitserve.transfer.direct_writes import DirectWrites
from splitserve.transfer.link import Fabric, Link, TransferError
from splitserve.transfer.protocol import (ALL, CANCEL, DONE, HELLO, LAYOUT_BYTES, CacheDest, IncompatibleKV,
                                          ProtocolError, TransferTicket, announce_retired, layout_from_tensor,
                                          message_tokens)

log = logging.getLogger("splitserve.transfer")
IDLE_RECV_S = 7 * 24 * 3600.0  # a receive loop waits this long for a header (a dead peer breaks the wait)


@dataclass(frozen=True)
class _Incoming:
    ticket: TransferTicket
    write_layer: Callable[[int, torch.Tensor, int], None]  # unpacks a layer's piece at an offset into its slots
    since: float  # when it was expected (monotonic)
    cursors: list[int]  # per layer: the next position to land (the receive loop's, under the lock)

    def missing(self) -> str | None:
        """What has not landed, or None."""
        short = [(layer, c) for layer, c in enumerate(self.cursors) if c < self.ticket.num_tokens]
        return None if not short else (f"{len(short)} layers' KV incomplete (layer {short[0][0]} landed up to "
                                       f"position {short[0][1]} of {self.ticket.num_tokens})")


class KVReceiver:
    def __init__(self, fabric: Fabric, wire_layer_shape: Callable[[int, int], tuple[int, ...]],
                 layer_groups: tuple[int, ...], dtype: torch.dtype, device: torch.device, timeout: float, layout: str,
                 max_tokens: int, max_heads: int):
        """The arguments are `KVTransport`'s."""
        self.fabric, self.timeout, self.layout = fabric, timeout, layout
        self.max_tokens, self.max_heads = max_tokens, max_heads
        self._layer_shape, self._groups, self._dtype, self._device = wire_layer_shape, layer_groups, dtype, device
        self._num_layers = len(layer_groups)
        self._epochs: dict[str, int] = {}  # the epoch of the link from each prompt peer
        self._heard: dict[tuple[str, int], float] = {}  # when each (peer, epoch) link last delivered
        self._incoming: dict[int, _Incoming] = {}
        self._results: list[tuple[TransferTicket, int | TransferError, torch.cuda.Event | None]] = []
        self._recv_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loops: set[tuple[str, int]] = set()  # (prompt peer, epoch) links being read
        self._threads: list[threading.Thread] = []  # the receive loops
        self._direct = DirectWrites(fabric, self._writes_done, self._wake)  # direct transfers being written
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # notified when a result is appended

    def expect(self, ticket: TransferTicket, write_layer: Callable[[int, torch.Tensor, int], None],
               dest: CacheDest | None = None) -> TransferTicket:
        """Register a reserved transfer; its layers are written by `write_layer(layer, payload,
        offset)` as they land (a piece `offset` positions after the layer's first), or,
        where the prompt peer shares this worker's memory, by the peer itself into `dest`.
        Returns the ticket stamped with the epoch of the link it comes on (and `dest` where the
        peer writes): give the prompt side that one."""
        peer = ticket.prompt_peer
        if dest is not None and self.fabric.direct(peer):
            ticket = dataclasses.replace(ticket, dest=dataclasses.replace(dest, claim_by=time.monotonic() + self.timeout))
        with self._lock:
            epoch = self._epochs.get(peer, 0)
        if self.fabric.retired(peer, self.fabric.worker_id, epoch):  # the prompt side gave the link up
            self._next_epoch(peer, epoch)
        with self._lock:
            ticket = dataclasses.replace(ticket, link_epoch=self._epochs.get(peer, 0))
            cursors = [ticket.start_of(group) for group in self._groups]
            self._incoming[ticket.tag] = _Incoming(ticket, write_layer, time.monotonic(), cursors)
            loop = (peer, ticket.link_epoch)
            start = loop not in self._loops
            self._loops.add(loop)
        self._direct.expect(ticket)  # before the prompt side has the ticket: nothing is written yet
        if start:
            thread = threading.Thread(target=self._receive_loop, args=loop, daemon=True, name=f"kv-recv-{peer}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return ticket

    def abandon(self, ticket: TransferTicket) -> bool:
        """Stop waiting for a transfer; messages still arriving for it are drained and dropped.
        Returns whether its blocks may be freed now; if not (a direct transfer whose sender may
        still write), `take_released` returns the ticket once they may."""
        with self._lock:
            self._incoming.pop(ticket.tag, None)
        self._order_after([self._writes_done()])  # its writes queued so far land before the blocks' next use
        return self._direct.give_up(ticket)

    def device_slots(self, host: Slots) -> Slots:
        """Host slots as the receive loop writes through them: CUDA, copied on the receive stream,
        so its writes follow the copy without waiting for the caller's stream (a decode step in
        flight), and their memory is reused only after the stream's work."""
        if self._recv_stream is None:
            return tuple(group.to(self._device) for group in host)
        with torch.cuda.stream(self._recv_stream):
            return tuple(group.pin_memory().to(self._device, non_blocking=True) for group in host)

    def take_released(self) -> list[TransferTicket]:
        """Held transfers whose senders have stopped writing; the caller's stream is ordered after
        their last writes."""
        released = self._direct.take_released()
        self._order_after(written for _, written in released)
        return [ticket for ticket, _ in released]

    def poll(self, timeout: float = 0.0) -> list[tuple[TransferTicket, int | TransferError]]:
        """Finished transfers: (ticket, first token id) or (ticket, TransferError); the caller's
        stream is ordered after their writes. With a timeout, blocks until one finishes or a held
        one is released (an idle worker sleeps instead of spinning, which would starve the receive
        threads of the GIL)."""
        with self._lock:
            if not self._results and not self._direct.pending() and timeout > 0:
                self._landed.wait(timeout)
            self._fail_silent(time.monotonic())
            results, self._results = self._results, []
        self._order_after(written for _, _, written in results)
        return [(ticket, result) for ticket, result, _ in results]

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` for the receive loops, which end as their senders close."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _order_after(self, events: Iterable[torch.cuda.Event | None]) -> None:
        """CUDA: the caller's stream waits for the writes each event marks."""
        for written in events:
            if written is not None:
                torch.cuda.current_stream(self._device).wait_event(written)

    def _check_hello(self, link: Link) -> None:
        header = torch.empty(4, dtype=torch.int64)
        link.recv_meta(header, self.timeout)
        if header[1].item() != HELLO:
            raise ProtocolError(link.peer, "the link did not open with HELLO (an older or foreign sender)")
        payload = torch.empty(LAYOUT_BYTES, dtype=torch.uint8)
        link.recv_meta(payload, self.timeout)
        theirs = layout_from_tensor(payload)
        if theirs != self.layout:
            raise IncompatibleKV(link.peer, self.fabric.worker_id, self.layout, theirs)

    def _receive_loop(self, peer: str, epoch: int) -> None:
        """Reads the epoch's link from `peer` until it fails; then the epoch is retired and every
        transfer from `peer` still waiting fails (the next ticket gets a fresh link). A direct link
        that broke the protocol is drained until its sender closes it."""
        link = None
        with torch.cuda.stream(self._recv_stream) if self._recv_stream else contextlib.nullcontext():
            try:
                link = self.fabric.link_from(peer, epoch)
                self._check_hello(link)
                while True:
                    self._receive_one(link, epoch)
            except Exception as error:  # a bug in one message must not leave this peer's transfers waiting
                if not isinstance(error, TransferError):
                    log.exception("KV receive loop for %s failed", peer)
                    error = ProtocolError(peer, f"receive failed: {type(error).__name__}: {error}")
                drain = link is not None and link.direct and isinstance(error, ProtocolError)
                if not drain:  # the link broke: its sender closed it or died, and writes no more (said
                    self._direct.link_ended(peer, epoch)  # before its transfers fail: they free at once)
                self._retire(peer, epoch, error)
                if drain:
                    self._drain(link)
                    self._direct.link_ended(peer, epoch)
            if link is not None:
                link.close()

    def _receive_one(self, link: Link, epoch: int) -> None:
        header = torch.empty(4, dtype=torch.int64)
        link.recv_meta(header, IDLE_RECV_S)  # silence is judged per transfer, in `poll`
        tag, kind, num_tokens, value = header.tolist()
        payload = None  # a direct link's KV is in the cache already
        if kind >= 0 or kind == ALL:
            self._check_size(link.peer, tag, kind, num_tokens, value)
            if not link.direct:
                shape = self._layer_shape(num_tokens, value)
                payload = torch.empty(shape if kind >= 0 else math.prod(shape), dtype=self._dtype, device=self._device)
                link.recv(payload, self.timeout)
        if kind == DONE or kind == CANCEL:
            link.fence()  # the transfer's direct writes come before what follows
        with self._lock:  # writes happen under the lock: once abandon() returns, none lands
            self._heard[link.peer, epoch] = time.monotonic()
            incoming = self._incoming.get(tag)
            if incoming is not None and (kind >= 0 or kind == ALL):
                self._land(incoming, kind, num_tokens, value, payload)
        if kind == DONE or kind == CANCEL:
            self._finish(tag, _result(link.peer, kind, value, incoming))
            self._direct.sender_done(tag)

    def _land(self, incoming: _Incoming, kind: int, num_tokens: int, num_heads: int,
              payload: torch.Tensor | None) -> None:
        """Under the lock: a checked KV message moves its layers' cursors on, and its payload (if it
        travelled) lands where they were."""
        ticket = incoming.ticket
        if kind >= 0:
            offset = incoming.cursors[kind] - ticket.start_of(self._groups[kind])
            incoming.cursors[kind] += num_tokens
            if payload is not None:
                incoming.write_layer(kind, payload, offset)
            return
        incoming.cursors[:] = [ticket.num_tokens] * self._num_layers
        if payload is not None:
            shapes = [self._layer_shape(message_tokens(ticket, layer, self._groups), num_heads)
                      for layer in range(self._num_layers)]
            for layer, wire in enumerate(split_layers(payload, shapes)):
                incoming.write_layer(layer, wire, 0)

    def _drain(self, link: Link) -> None:
        """A direct link that broke the protocol is read on, every message dropped, until its
        sender closes it (or dies): each held transfer's blocks are freed once its sender is done
        with them."""
        header = torch.empty(4, dtype=torch.int64)
        while True:
            try:
                link.recv_meta(header, IDLE_RECV_S)
            except TransferError:
                return
            tag, kind = header[0].item(), header[1].item()
            if kind == DONE or kind == CANCEL:
                link.fence()
                self._direct.sender_done(tag)

    def _check_size(self, peer: str, tag: int, kind: int, num_tokens: int, num_heads: int) -> None:
        """A payload fits what its reservation has left to land (a layer's piece, at most the rest of
        the layer; ALL, every layer whole, before any piece): a header that says otherwise is a
        broken or foreign sender, and nothing is allocated for it."""
        if kind >= self._num_layers:
            raise ProtocolError(peer, f"message for tag {tag} names layer {kind} of {self._num_layers}")
        with self._lock:
            incoming = self._incoming.get(tag)
            cursors = None if incoming is None else list(incoming.cursors)
        ticket = None if incoming is None else incoming.ticket
        most = self.max_tokens * (self._num_layers if kind == ALL else 1)
        held, fits = "", 0 < num_tokens <= most and 0 < num_heads <= self.max_heads
        if ticket is not None:
            if kind == ALL:
                expected = message_tokens(ticket, ALL, self._groups)
                fits &= num_tokens == expected and cursors == [ticket.start_of(g) for g in self._groups]
                held = f"; the reservation expects every layer whole, {expected} tokens,"
            else:
                left = ticket.num_tokens - cursors[kind]
                fits &= num_tokens <= left
                held = f"; the reservation has {left} tokens of the layer left (from position {cursors[kind]})"
            fits &= _num_heads(ticket) in (None, num_heads)
            held += f" of heads {ticket.heads}"
        if not fits:
            raise ProtocolError(peer, f"message for tag {tag} (kind {kind}) announces {num_tokens} tokens of "
                                      f"{num_heads} KV heads{held} (at most {most} tokens of "
                                      f"{self.max_heads} heads)")

    def _finish(self, tag: int, result: int | TransferError) -> None:
        with self._lock:
            self._finish_locked(tag, result)

    def _finish_locked(self, tag: int, result: int | TransferError) -> None:
        incoming = self._incoming.pop(tag, None)
        if incoming is not None:
            self._results.append((incoming.ticket, result, self._writes_done()))
            self._landed.notify_all()

    def _wake(self) -> None:
        """A `poll` waiting for something to finish looks again (held transfers were released)."""
        with self._lock:
            self._landed.notify_all()

    def _writes_done(self) -> torch.cuda.Event | None:
        """CUDA: an event after every write queued on the receive stream so far."""
        if self._recv_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._recv_stream)
        return event

    def _retire(self, peer: str, epoch: int, error: TransferError) -> None:
        """The epoch's link from `peer` failed: later tickets name the next epoch, and every
        transfer from `peer` still waiting fails (all were stamped with this epoch or older)."""
        self._next_epoch(peer, epoch)
        with self._lock:
            self._loops.discard((peer, epoch))
            self._heard.pop((peer, epoch), None)
            for tag, incoming in list(self._incoming.items()):
                if incoming.ticket.prompt_peer == peer and incoming.ticket.link_epoch <= epoch:
                    self._finish_locked(tag, error)
        announce_retired(self.fabric, peer, self.fabric.worker_id, epoch)

    def _next_epoch(self, peer: str, failed: int) -> None:
        with self._lock:
            self._epochs[peer] = max(self._epochs.get(peer, 0), failed + 1)

    def _fail_silent(self, now: float) -> None:
        """Under the lock: a transfer whose peer has sent nothing for `timeout` since it was
        expected fails (the peer is stalled or never got the ticket); the link stays."""
        for tag, incoming in list(self._incoming.items()):
            peer, epoch = incoming.ticket.prompt_peer, incoming.ticket.link_epoch
            if now - max(incoming.since, self._heard.get((peer, epoch), 0.0)) > self.timeout:
                self._finish_locked(tag, TransferError(peer, f"nothing received from it for {self.timeout:g} s"))


def _result(peer: str, kind: int, value: int, incoming: _Incoming | None) -> int | TransferError:
    """What a DONE (value: the first token) or CANCEL ends its transfer with."""
    if kind == CANCEL:
        return TransferError(peer, "cancelled by the prompt worker")
    missing = None if incoming is None else incoming.missing()
    return value if missing is None else ProtocolError(peer, f"it completed a transfer with {missing}")


def _num_heads(ticket: TransferTicket) -> int | None:
    return None if ticket.heads is None else ticket.heads[1] - ticket.heads[0]
