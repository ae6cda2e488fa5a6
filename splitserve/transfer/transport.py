"""KVTransport: moves a prompt's KV from a prompt worker to a token worker over ordered links.

Semantics:
- The token worker reserves blocks first and issues a `TransferTicket` (request id, a tag unique
  among its transfers, both peers, the prompt length, per-layer or one-shot, and `start_token`:
  the first prompt position whose KV it needs, the ones before being in its prefix cache). The
  prompt worker pushes the KV of positions start_token .. num_tokens-1 against the ticket; it
  never learns the token side's block ids.
- Push: per layer (`push_layer`, as each layer's KV is computed) or one shot (`push_all`, after
  the prefill), then `complete` with the first token. `cancel` tells the token side to give up.
- Every message is a header int64[4] = (tag, kind, num_sent_tokens, value), a CPU tensor on the
  link's metadata channel (read without waiting for the device), and, for KV kinds, a payload in
  the codec's wire format on the data path (value: its number of KV heads). kind >= 0 is a layer
  index; ALL, DONE (value: the first token) and CANCEL below.
- With tensor parallelism every rank has a transport of its own and a transfer travels as parts,
  one per (prompt rank, token rank) route (`kv_routes`); this class moves parts and knows nothing
  of ranks.
- CUDA: payloads are received and written into the cache on a stream of their own, so a receive
  never waits for the decode step in flight; `poll` orders the caller's stream after a finished
  transfer's writes (an event) before the request can decode. The prompt side never waits for
  its pushes to leave (`reap` and `all_sent` look without blocking; a send that has not left
  after `timeout` fails its link).
- The token side runs one receive loop per prompt peer, from its first transfer until the link
  fails, and reads every message the peer sends (those of abandoned transfers are dropped): a
  sender never waits on a reader that stopped. A transfer ends in `poll()` as completed (first
  token) or failed (`TransferError` naming the peer): a failure on a link fails every transfer on
  it; a peer silent for `timeout` while a transfer waits on it fails that transfer, not the link.
- Links heal: each (prompt, token) pair's link has an epoch, chosen by the token side and carried
  by the ticket. When its link fails, the token side retires the epoch and stamps later tickets
  with the next, and the prompt side opens a fresh link for a newer epoch (a link cannot reopen
  under the same name), so one broken link costs the transfers that were on it, never the pair.
  The prompt side never dials an epoch it saw fail, or one the token side retired.
- Compatibility: each side checks the other's KV layout (model, dtype, per-token shape) before
  the first transfer between them. The ticket carries the token side's; the prompt side refuses a
  ticket whose layout is not its own (`check_compatible`). The first message on every new link is
  HELLO with the prompt side's layout; the token side fails the link, and every transfer on it,
  when it is not its own. A mismatch is an error naming both workers, never a write.
- Direct tickets (the token side's fabric says the prompt peer shares its memory: `direct_link`)
  carry the token side's block table (`dest`); the prompt side writes the KV into those blocks
  (`write_kv`) and only headers travel. Such a transfer's blocks are written by another process,
  so they are freed only once the sender cannot write into them any more: the sender claims a
  transfer before its first write (`claim`; refused once the token side gave it up), and a
  claimed transfer abandoned before its sender finished is held (`abandon` returns False) until
  the sender's DONE or CANCEL for it is read, or its link ends (the sender closed it or died);
  `take_released` hands them back. A direct link whose messages fail a check is read on,
  dropping them, until its sender closes it, for the same reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from splitserve.transfer.direct_writes import DirectWrites
from splitserve.transfer.link import Fabric, Link, TransferError

ALL, DONE, CANCEL, HELLO = -1, -2, -3, -4
log = logging.getLogger("splitserve.transfer")
LAYOUT_BYTES = 512  # HELLO's payload: the layout string, utf-8, zero-padded
IDLE_RECV_S = 7 * 24 * 3600.0  # a receive loop waits this long for a header (a dead peer breaks the wait)


class ProtocolError(TransferError):
    """A message broke the protocol (the link itself works)."""


class IncompatibleKV(ProtocolError):
    """Two workers whose KV cannot be exchanged (different model, dtype or layout)."""

    def __init__(self, peer: str, this_worker: str, ours: str, theirs: str):
        super().__init__(peer, f"worker {this_worker!r} has KV layout [{ours}] but worker {peer!r} has "
                               f"[{theirs}]: they serve different models or settings and cannot exchange KV")


@dataclass(frozen=True)
class CacheDest:
    """Where a direct transfer's KV goes in the token rank's cache."""

    blocks: tuple[int, ...]  # the reservation's block table, from position 0
    heads: tuple[int, int] | None = None  # the part's KV heads among the rank's own; None: all
    claim_by: float = 0.0  # the sender claims the transfer by this time.monotonic() (one node: one clock)


@dataclass(frozen=True)
class TransferTicket:
    request_id: str
    tag: int
    prompt_peer: str
    token_peer: str
    num_tokens: int
    layerwise: bool
    kv_layout: str = ""  # the token worker's (`kv_layout` in handoff)
    start_token: int = 0  # the first prompt position whose KV travels (the token side holds those before)
    link_epoch: int = 0  # the token side's link from prompt_peer that carries it (stamped by `expect`)
    prompt_rank: int = 0  # a part: the ranks it goes between and the KV heads [lo, hi) it carries
    token_rank: int = 0
    heads: tuple[int, int] | None = None
    parts: tuple["TransferTicket", ...] = ()  # a whole transfer: its parts (`kv_routes.split_ticket`)
    dest: CacheDest | None = None  # a direct part: written into these blocks (stamped by `expect`)

    def __post_init__(self):
        if not 0 <= self.start_token < self.num_tokens:  # at least the last token's KV travels
            raise ValueError(f"TransferTicket start_token must be in [0, num_tokens={self.num_tokens}), "
                             f"got {self.start_token}")

    @property
    def num_sent_tokens(self) -> int:
        """Tokens whose KV travels: positions start_token .. num_tokens-1."""
        return self.num_tokens - self.start_token


@dataclass(frozen=True)
class _Incoming:
    ticket: TransferTicket
    write_layer: Callable[[int, torch.Tensor], None]  # unpacks one layer into the reserved blocks
    since: float  # when it was expected (monotonic)


class KVTransport:
    def __init__(self, fabric: Fabric, wire_layer_shape: Callable[[int, int], tuple[int, ...]], num_layers: int,
                 dtype: torch.dtype, device: torch.device, timeout: float = 60.0, layout: str = "",
                 max_tokens: int = 2**31 - 1, max_heads: int = 2**31 - 1):
        """`wire_layer_shape(num_tokens, num_heads)` is one layer's payload shape (see
        codec.wire_shape); `layout` what must match on the other side (handoff.kv_layout);
        `max_tokens` the longest prompt a reservation can hold and `max_heads` the KV heads this
        rank holds (a payload is sized by its ticket, never past these)."""
        self.fabric, self.timeout, self.layout = fabric, timeout, layout
        self.max_tokens, self.max_heads = max_tokens, max_heads
        if len(layout.encode()) > LAYOUT_BYTES:
            raise ValueError(f"layout is longer than {LAYOUT_BYTES} bytes: {layout!r}")
        self._layer_shape, self._num_layers, self._dtype, self._device = wire_layer_shape, num_layers, dtype, device
        self._out: dict[str, tuple[int, Link]] = {}  # prompt side: (epoch, link) to each token peer
        self._failed_out: dict[str, int] = {}  # prompt side: the newest epoch to a token peer that failed
        self._epoch_seen: dict[tuple[str, int], float] = {}  # prompt side: when a link not yet opened was first named
        self._epochs: dict[str, int] = {}  # token side: the epoch of the link from each prompt peer
        self._heard: dict[tuple[str, int], float] = {}  # token side: when each (peer, epoch) link last delivered
        self._incoming: dict[int, _Incoming] = {}
        self._results: list[tuple[TransferTicket, int | TransferError, torch.cuda.Event | None]] = []
        self._recv_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loops: set[tuple[str, int]] = set()  # token side: (prompt peer, epoch) links being read
        self._threads: list[threading.Thread] = []  # token side: the receive loops
        self._direct = DirectWrites(fabric, self._writes_done, self._wake)  # token side: direct transfers written
        self._claims: set[tuple[str, int]] = set()  # prompt side: (token peer, tag) of direct transfers it claimed
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # notified when a result is appended

    # ---- prompt side ---------------------------------------------------------------------
    def check_compatible(self, ticket: TransferTicket) -> None:
        """On taking a ticket: refuses another layout, and notes when the ticket's link epoch was
        first seen (the token side waits `timeout` from about then for that link to open)."""
        if ticket.kv_layout != self.layout:
            raise IncompatibleKV(ticket.token_peer, ticket.prompt_peer, self.layout, ticket.kv_layout)
        if ticket.token_peer not in self._out or self._out[ticket.token_peer][0] != ticket.link_epoch:
            self._epoch_seen.setdefault((ticket.token_peer, ticket.link_epoch), time.monotonic())

    def push_layer(self, ticket: TransferTicket, layer: int, payload: torch.Tensor) -> None:
        self._send(ticket, layer, payload, payload.shape[-2])

    def push_all(self, ticket: TransferTicket, payload: torch.Tensor) -> None:
        self._send(ticket, ALL, payload, payload.shape[-2])

    def claim(self, ticket: TransferTicket) -> None:
        """A direct ticket: take it before the first write (done by `write_kv` if not before);
        raises TransferError when the token side gave it up first."""
        key = (ticket.token_peer, ticket.tag)
        if ticket.dest is None or key in self._claims:
            return
        if not self.fabric.claim(ticket.token_peer, ticket.tag, ticket.dest.claim_by):
            with contextlib.suppress(TransferError):
                self.cancel(ticket)  # ends it on the token side, whatever it saw
            raise TransferError(ticket.token_peer, "it gave the transfer up before this worker claimed it")
        self._claims.add(key)

    def write_kv(self, ticket: TransferTicket, kind: int, source: torch.Tensor, slots: torch.Tensor,
                 heads: slice | None) -> int:
        """A direct ticket: writes layer `kind` (or ALL layers) of this rank's cache data at
        `slots`, `heads` of its own, into the token worker's blocks, then announces it. Returns the bytes."""
        self.claim(ticket)
        link = self._link_to(ticket)
        layers = slice(None) if kind == ALL else slice(kind, kind + 1)
        num_heads = source.shape[-2] if heads is None else len(range(source.shape[-2])[heads])
        try:
            written = link.write(source, slots, layers, heads, ticket.dest, ticket.start_token)
            link.send_meta(_header(ticket.tag, kind, ticket.num_sent_tokens, num_heads))
        except TransferError:
            self._drop_out(ticket.token_peer)
            raise
        return written

    def complete(self, ticket: TransferTicket, first_token_id: int) -> None:
        self._send(ticket, DONE, None, first_token_id)

    def cancel(self, ticket: TransferTicket) -> None:
        self._send(ticket, CANCEL, None)

    def reap(self) -> list[TransferError]:
        """Without waiting: the links whose sends failed, or have not left within `timeout`
        (each closed for good, as on the receiving side)."""
        errors = []
        for peer, (_, link) in list(self._out.items()):
            try:
                link.unsent(self.timeout)
            except TransferError as error:
                errors.append(error)
                self._drop_out(peer)
        return errors

    def all_sent(self, peers: Iterable[str]) -> bool:
        """Whether everything pushed to `peers` has left (a dropped link has nothing left to send)."""
        try:
            return all(self._out[p][1].unsent(self.timeout) == 0 for p in peers if p in self._out)
        except TransferError:
            return False  # `reap` reports it

    def flush(self, timeout: float | None = None) -> list[TransferError]:
        """Wait for every pushed message to leave; returns the failures (one per broken peer).
        A failed link is closed for good, as on the receiving side."""
        errors = []
        for peer, (_, link) in list(self._out.items()):
            try:
                link.flush(self.timeout if timeout is None else timeout)
            except TransferError as error:
                errors.append(error)
                self._drop_out(peer)
        return errors

    # ---- token side ----------------------------------------------------------------------
    def expect(self, ticket: TransferTicket, write_layer: Callable[[int, torch.Tensor], None],
               dest: CacheDest | None = None) -> TransferTicket:
        """Register a reserved transfer; its layers are written by `write_layer` as they land, or,
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
            self._incoming[ticket.tag] = _Incoming(ticket, write_layer, time.monotonic())
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
        return self._direct.give_up(ticket)

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

    def close(self, timeout: float = 10.0) -> None:
        """Closes the links this side sends on (each peer's receive loop ends with its link), then
        waits up to `timeout` for this side's own receive loops, which end as their senders close."""
        for peer in list(self._out):
            self._drop_out(peer)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ---- internals -----------------------------------------------------------------------
    def _order_after(self, events: Iterable[torch.cuda.Event | None]) -> None:
        """CUDA: the caller's stream waits for the writes each event marks."""
        for written in events:
            if written is not None:
                torch.cuda.current_stream(self._device).wait_event(written)

    def _send(self, ticket: TransferTicket, kind: int, payload: torch.Tensor | None, value: int = 0) -> None:
        link = self._link_to(ticket)
        try:
            if kind in (DONE, CANCEL):  # a transfer's last message: its direct writes come before it
                link.seal()
                self._claims.discard((ticket.token_peer, ticket.tag))
            link.send_meta(_header(ticket.tag, kind, ticket.num_sent_tokens, value))
            if payload is not None:
                link.send(payload)
        except TransferError:
            self._drop_out(ticket.token_peer)
            raise

    def _link_to(self, ticket: TransferTicket) -> Link:
        """The link of the ticket's epoch; a newer epoch replaces the link (the token side has
        given the old one up). An epoch that failed is never dialled again: a dead peer would hold
        the push for `timeout` as it tried."""
        peer, epoch = ticket.token_peer, ticket.link_epoch
        current = self._out.get(peer)
        if current is not None and current[0] == epoch:
            if current[1].direct != (ticket.dest is not None):
                raise TransferError(peer, "its tickets disagree on whether this worker writes into its cache")
            return current[1]
        if epoch <= self._failed_out.get(peer, -1) or self.fabric.retired(self.fabric.worker_id, peer, epoch):
            self._failed_out[peer] = max(epoch, self._failed_out.get(peer, -1))
            raise TransferError(peer, f"its link (epoch {epoch}) failed before; the token worker opens the next")
        if current is not None and current[0] > epoch:
            raise TransferError(peer, f"the ticket's link (epoch {epoch}) was replaced by epoch {current[0]}")
        seen = self._epoch_seen.pop((peer, epoch), None)
        if seen is not None and time.monotonic() - seen > self.timeout:  # dialling would wait on nobody
            self._failed_out[peer] = max(epoch, self._failed_out.get(peer, -1))
            raise TransferError(peer, f"its link (epoch {epoch}) was not opened within {self.timeout:g} s of its "
                                      "first ticket: the token worker has stopped waiting for it")
        if current is not None:
            self._drop_out(peer)
        try:
            dial = self.fabric.link_to if ticket.dest is None else self.fabric.direct_link_to
            link = self._hello(dial(peer, epoch))
        except TransferError:
            self._failed_out[peer] = epoch
            raise
        self._out[peer] = (epoch, link)
        return link

    def _drop_out(self, peer: str) -> None:
        """A failed or replaced link is closed, its epoch not dialled again, and the token side
        told (its next ticket names the next epoch)."""
        epoch, link = self._out.pop(peer)
        self._failed_out[peer] = max(epoch, self._failed_out.get(peer, -1))
        self._claims = {claim for claim in self._claims if claim[0] != peer}  # its link's end releases them
        link.close()
        self._announce_retired(self.fabric.worker_id, peer, epoch)

    def _hello(self, link: Link) -> Link:
        """A new link's first message: this side's layout, for the receiver to check."""
        link.send_meta(_header(0, HELLO, 0, 0))
        link.send_meta(_layout_tensor(self.layout))
        return link

    def _check_hello(self, link: Link) -> None:
        header = torch.empty(4, dtype=torch.int64)
        link.recv_meta(header, self.timeout)
        if header[1].item() != HELLO:
            raise ProtocolError(link.peer, "the link did not open with HELLO (an older or foreign sender)")
        payload = torch.empty(LAYOUT_BYTES, dtype=torch.uint8)
        link.recv_meta(payload, self.timeout)
        theirs = bytes(payload.tolist()).rstrip(b"\0").decode(errors="replace")
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
        if kind >= 0 or kind == ALL:
            self._check_size(link.peer, tag, kind, num_tokens, value)
            if not link.direct:
                shape = self._layer_shape(num_tokens, value)
                payload = torch.empty(shape if kind >= 0 else (self._num_layers, *shape), dtype=self._dtype,
                                      device=self._device)
                link.recv(payload, self.timeout)
        if kind == DONE or kind == CANCEL:
            link.fence()  # the transfer's direct writes come before what follows
        with self._lock:  # writes happen under the lock: once abandon() returns, none lands
            self._heard[link.peer, epoch] = time.monotonic()
            incoming = self._incoming.get(tag)
            if incoming is not None and not link.direct:
                if kind >= 0:
                    incoming.write_layer(kind, payload)
                elif kind == ALL:
                    for layer in range(payload.shape[0]):
                        incoming.write_layer(layer, payload[layer])
        if kind == DONE or kind == CANCEL:
            result = value if kind == DONE else TransferError(link.peer, "cancelled by the prompt worker")
            self._finish(tag, result)
            self._direct.sender_done(tag)

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
        """A payload is as large as its reservation: a header that says otherwise is a broken or
        foreign sender, and nothing is allocated for it."""
        with self._lock:
            incoming = self._incoming.get(tag)
        ticket = incoming.ticket if incoming is not None else None
        unlike = ticket is not None and (ticket.num_sent_tokens != num_tokens
                                         or _num_heads(ticket) not in (None, num_heads))
        if unlike or not (0 < num_tokens <= self.max_tokens and 0 < num_heads <= self.max_heads) \
                or kind >= self._num_layers:
            held = "" if ticket is None else (f"; the reservation expects {ticket.num_sent_tokens} tokens (from "
                                              f"position {ticket.start_token}) of heads {ticket.heads}")
            raise ProtocolError(peer, f"message for tag {tag} (kind {kind}) announces {num_tokens} tokens of "
                                      f"{num_heads} KV heads{held} (at most {self.max_tokens} tokens of "
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
        self._announce_retired(peer, self.fabric.worker_id, epoch)

    def _next_epoch(self, peer: str, failed: int) -> None:
        with self._lock:
            self._epochs[peer] = max(self._epochs.get(peer, 0), failed + 1)

    def _announce_retired(self, sender: str, receiver: str, epoch: int) -> None:
        """Best effort: the other side learns it at its next transfer, or from its own failure."""
        try:
            self.fabric.retire(sender, receiver, epoch)
        except Exception:  # the rendezvous store is gone: nothing else would reach the peer either
            log.warning("could not announce that the KV link %s->%s (epoch %d) is retired", sender, receiver,
                        epoch, exc_info=True)

    def _fail_silent(self, now: float) -> None:
        """Under the lock: a transfer whose peer has sent nothing for `timeout` since it was
        expected fails (the peer is stalled or never got the ticket); the link stays."""
        for tag, incoming in list(self._incoming.items()):
            peer, epoch = incoming.ticket.prompt_peer, incoming.ticket.link_epoch
            if now - max(incoming.since, self._heard.get((peer, epoch), 0.0)) > self.timeout:
                self._finish_locked(tag, TransferError(peer, f"nothing received from it for {self.timeout:g} s"))


def _num_heads(ticket: TransferTicket) -> int | None:
    return None if ticket.heads is None else ticket.heads[1] - ticket.heads[0]


def _header(tag: int, kind: int, num_tokens: int, value: int) -> torch.Tensor:
    return torch.tensor([tag, kind, num_tokens, value], dtype=torch.int64)


def _layout_tensor(layout: str) -> torch.Tensor:
    data = layout.encode().ljust(LAYOUT_BYTES, b"\0")
    return torch.tensor(list(data), dtype=torch.uint8)
