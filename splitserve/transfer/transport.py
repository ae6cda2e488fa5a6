"""KVTransport: moves a prompt's KV from a prompt worker to a token worker over ordered links.

This module holds the facade and the prompt (sending) side; the token (receiving) side is
`receiver.KVReceiver`, and what both sides agree on (tickets, headers, errors) is in `protocol`.

Semantics:
- The token worker reserves blocks first and issues a `TransferTicket` (request id, a tag unique
  among its transfers, both peers, the prompt length, per-layer or one-shot, and `start_token`:
  the first prompt position whose KV it needs, the ones before being in its prefix cache). The
  prompt worker pushes the KV of positions start_token .. num_tokens-1 against the ticket; it
  never learns the token side's block ids.
- Push: per layer (`push_layer`, as each layer's KV is computed) or one shot (`push_all`, after
  the prefill), then `complete` with the first token. `cancel` tells the token side to give up.
  A layer may go in pieces (`protocol.Span`), in position order: a prompt prefilled in chunks
  pushes each chunk's KV as it lands; the token side writes each piece where the layer's last
  one ended, and a transfer completes only once every layer has all its positions.
- Every message is a header int64[4] = (tag, kind, num_tokens, value), a CPU tensor on the
  link's metadata channel (read without waiting for the device), and, for KV kinds, a payload in
  the codec's wire format on the data path (value: its number of KV heads). kind >= 0 is a layer
  index; ALL (every layer's payload, flat), DONE (value: the first token) and CANCEL below.
- Windowed layer groups: the ticket's `group_starts` say from which position each layer group's
  KV travels (the token side's windowed groups hold only what their first decode reaches), so a
  whole layer carries `message_tokens` tokens and a long prompt's windowed layers are short.
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
import time
from collections.abc import Callable, Iterable

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.transfer.codec import Slots, count_heads
from splitserve.transfer.link import Fabric, Link, TransferError
from splitserve.transfer.protocol import (ALL, CANCEL, DONE, HELLO, LAYOUT_BYTES, CacheDest, IncompatibleKV,
                                          ProtocolError, Span, TransferTicket, announce_retired, header,
                                          layout_tensor, message_tokens)
from splitserve.transfer.receiver import KVReceiver


class KVTransport:
    def __init__(self, fabric: Fabric, wire_layer_shape: Callable[[int, int], tuple[int, ...]], num_layers: int,
                 dtype: torch.dtype, device: torch.device, timeout: float = 60.0, layout: str = "",
                 max_tokens: int = 2**31 - 1, max_heads: int = 2**31 - 1, layer_groups: tuple[int, ...] = ()):
        """`wire_layer_shape(num_tokens, num_heads)` is one layer's payload shape (see
        codec.wire_shape); `layout` what must match on the other side (handoff.kv_layout);
        `max_tokens` the longest prompt a reservation can hold and `max_heads` the KV heads this
        rank holds (a payload is sized by its ticket, never past these); `layer_groups` each
        layer's KV group (engine.kv_groups; (): one group)."""
        if len(layout.encode()) > LAYOUT_BYTES:
            raise ValueError(f"layout is longer than {LAYOUT_BYTES} bytes: {layout!r}")
        self._groups = layer_groups or (0,) * num_layers
        if len(self._groups) != num_layers:
            raise ValueError(f"layer_groups names {len(self._groups)} layers, not {num_layers}")
        self._num_groups = 1 + max(self._groups)
        self._out: dict[str, tuple[int, Link]] = {}  # prompt side: (epoch, link) to each token peer
        self._failed_out: dict[str, int] = {}  # prompt side: the newest epoch to a token peer that failed
        self._epoch_seen: dict[tuple[str, int], float] = {}  # prompt side: when a link not yet opened was first named
        self._claims: set[tuple[str, int]] = set()  # prompt side: (token peer, tag) of direct transfers it claimed
        self._receiver = KVReceiver(fabric, wire_layer_shape, self._groups, dtype, device, timeout, layout,
                                    max_tokens, max_heads)  # the token side

    # One fabric, layout and timeout serve both sides: the receiver holds them, this side reads them there
    @property
    def fabric(self) -> Fabric:
        return self._receiver.fabric

    @property
    def layout(self) -> str:
        return self._receiver.layout

    @property
    def timeout(self) -> float:
        return self._receiver.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._receiver.timeout = seconds

    # ---- prompt side ---------------------------------------------------------------------
    def check_compatible(self, ticket: TransferTicket) -> None:
        """On taking a ticket: refuses another layout, and notes when the ticket's link epoch was
        first seen (the token side waits `timeout` from about then for that link to open)."""
        if ticket.kv_layout != self.layout:
            raise IncompatibleKV(ticket.token_peer, ticket.prompt_peer, self.layout, ticket.kv_layout)
        if len(ticket.group_starts) not in (0, self._num_groups):
            raise ProtocolError(ticket.token_peer, f"its ticket names {len(ticket.group_starts)} KV layer groups' "
                                                   f"starts; this worker's KV has {self._num_groups} groups")
        if ticket.token_peer not in self._out or self._out[ticket.token_peer][0] != ticket.link_epoch:
            self._epoch_seen.setdefault((ticket.token_peer, ticket.link_epoch), time.monotonic())

    def push_layer(self, ticket: TransferTicket, layer: int, payload: torch.Tensor) -> None:
        """`payload`: [2, tokens, KV heads, head_dim] (codec.pack_layer): the layer's next piece, or
        all of it."""
        self._send(ticket, layer, payload, payload.shape[-2])

    def push_all(self, ticket: TransferTicket, payload: torch.Tensor, num_heads: int) -> None:
        """`payload`: every layer's, of `num_heads` KV heads, one after the other (codec.pack_all)."""
        self._send(ticket, ALL, payload.reshape(-1), num_heads)

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

    def write_kv(self, ticket: TransferTicket, kind: int, source: KVCache, slots: Slots,
                 heads: slice | None, span: Span | None = None) -> int:
        """A direct ticket: writes layer `kind` (or ALL layers) of this rank's cache at `slots`
        (per layer group), `heads` of its own, into the token worker's blocks, then announces it;
        `span`: the layer's piece those slots hold (None: all of it). Returns the bytes."""
        self.claim(ticket)
        link = self._link_to(ticket)
        span = span or ticket.span(self._num_groups)  # the token side checks that a piece follows the last
        layers = slice(None) if kind == ALL else slice(kind, kind + 1)
        num_heads = count_heads(source.data.shape[-2], heads)
        tokens = message_tokens(ticket, ALL, self._groups) if kind == ALL else span.tokens(self._groups[kind])
        try:
            written = link.write(source, slots, layers, heads, ticket.dest, span.starts, span.end)
            link.send_meta(header(ticket.tag, kind, tokens, num_heads))
        except TransferError:
            self._drop_out(ticket.token_peer)
            raise
        return written

    def complete(self, ticket: TransferTicket, first_token_id: int) -> None:
        self._send(ticket, DONE, None, first_token_id)

    def cancel(self, ticket: TransferTicket) -> None:
        self._send(ticket, CANCEL, None)

    def release(self, ticket: TransferTicket) -> None:
        """A direct ticket this side claimed and will not finish: CANCEL, so the token side frees
        its blocks (it holds them until then, or until this link ends); nothing for a ticket this
        side never claimed, or whose link failed (that link's end released it)."""
        if (ticket.token_peer, ticket.tag) in self._claims:
            self.cancel(ticket)

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

    def peers(self) -> frozenset[str]:
        """The peers this side holds a link to send on."""
        return frozenset(self._out)

    def forget_peers(self, peers: Iterable[str]) -> None:
        """`peers` left the cluster for good (worker ids are never reused): the links this side
        sends on to them close, and what it kept about them goes. (A link to a peer that died with
        nothing in flight never fails a send, so nothing else would close it: a long-lived prompt
        worker outlives many token workers.) The links they sent on end as their processes did."""
        gone = set(peers)
        for peer in gone & set(self._out):
            self._out.pop(peer)[1].close()
        self._failed_out = {peer: epoch for peer, epoch in self._failed_out.items() if peer not in gone}
        self._epoch_seen = {key: seen for key, seen in self._epoch_seen.items() if key[0] not in gone}
        self._claims = {claim for claim in self._claims if claim[0] not in gone}

    # ---- token side: `KVReceiver`'s (documented there) -----------------------------------
    def expect(self, ticket: TransferTicket, write_layer: Callable[[int, torch.Tensor], None],
               dest: CacheDest | None = None) -> TransferTicket:
        return self._receiver.expect(ticket, write_layer, dest)

    def abandon(self, ticket: TransferTicket) -> bool:
        return self._receiver.abandon(ticket)

    def device_slots(self, host: Slots) -> Slots:
        return self._receiver.device_slots(host)

    def take_released(self) -> list[TransferTicket]:
        return self._receiver.take_released()

    def poll(self, timeout: float = 0.0) -> list[tuple[TransferTicket, int | TransferError]]:
        return self._receiver.poll(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Closes the links this side sends on (each peer's receive loop ends with its link), then
        waits up to `timeout` in all for their threads and for this side's own receive loops,
        which end as their senders close: the process may exit then."""
        deadline = time.monotonic() + timeout
        closing = [link for _, link in self._out.values()]
        for peer in list(self._out):
            self._drop_out(peer)
        for link in closing:
            link.join(max(0.0, deadline - time.monotonic()))
        self._receiver.join(max(0.0, deadline - time.monotonic()))

    # ---- prompt side internals -------------------------------------------------------------
    def _send(self, ticket: TransferTicket, kind: int, payload: torch.Tensor | None, value: int = 0) -> None:
        link = self._link_to(ticket)
        try:
            if kind in (DONE, CANCEL):  # a transfer's last message: its direct writes come before it
                link.seal()
                self._claims.discard((ticket.token_peer, ticket.tag))
            if payload is None:
                tokens = ticket.num_sent_tokens
            elif kind == ALL:
                tokens = message_tokens(ticket, ALL, self._groups)
            else:  # the layer's piece
                tokens = payload.shape[-3]
            link.send_meta(header(ticket.tag, kind, tokens, value))
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
        announce_retired(self.fabric, self.fabric.worker_id, peer, epoch)

    def _hello(self, link: Link) -> Link:
        """A new link's first message: this side's layout, for the receiver to check."""
        link.send_meta(header(0, HELLO, 0, 0))
        link.send_meta(layout_tensor(self.layout))
        return link

