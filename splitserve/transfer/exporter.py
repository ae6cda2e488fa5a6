"""The prompt worker's side of a handoff (`KVExporter`): pushes each layer's KV as the prefill
writes it (a prompt prefilled in chunks: each step's new positions, a piece of every layer), then
the first token; how the pushes overlapped the compute (`TransferStats`). The whole protocol:
`handoff`."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.policies import Plan
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import Slots, as_lists, slot_index
from splitserve.transfer.handoff import LAYERWISE_THRESHOLD, parts_of
from splitserve.transfer.link import TransferError
from splitserve.transfer.protocol import Span
from splitserve.transfer.rank_commands import CancelExport, FinishExport, ForgetPeers, PushLayers, RankReport
from splitserve.transfer.rank_kv import RankKV
from splitserve.transfer.transport import KVTransport, TransferTicket


@dataclass(frozen=True)
class TransferStats:
    """One step's pushes: what they added to the critical path (packing and pushing on the compute
    thread, which never waits for them to leave) against their whole span (first push to the last
    leaving)."""

    visible_seconds: float
    span_seconds: float

    @property
    def overlap_ratio(self) -> float:
        """Fraction of the transfer hidden behind compute (0: fully serialized)."""
        if self.span_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.visible_seconds / self.span_seconds))


@dataclass(frozen=True)
class _Piece:
    """What a step pushes of a layer-wise transfer: every layer's positions in `span`, at `slots`
    (on the cache's device; `host_slots` the same, for the other ranks: no device sync to read)."""

    ticket: TransferTicket
    slots: Slots
    host_slots: Slots
    span: Span


@dataclass(frozen=True)
class _Sending:
    tickets: dict[str, TransferTicket]
    first_push: float
    visible_seconds: float


class KVExporter:
    def __init__(self, engine: LLMEngine, transport: KVTransport, lease_s: float = float("inf"),
                 min_piece_tokens: int = LAYERWISE_THRESHOLD):
        """`min_piece_tokens`: a step that does not complete a layer-wise prefill pushes its pieces
        once this many positions are pending (a piece costs a message per layer, whatever its size);
        the step that completes it pushes the rest."""
        self.engine, self.transport, self.lease_s, self.min_piece_tokens = engine, transport, lease_s, min_piece_tokens
        self.rank = RankKV(transport, engine.kv_cache, engine.model_config.num_key_value_heads)
        self.leader = engine.tp_leader
        if self.leader is not None:
            self.leader.listeners.append(self._take_reports)
        self._deadlines: dict[str, float] = {}
        self.leases_expired = 0
        self._tickets: dict[str, TransferTicket] = {}
        self._pushed_to: dict[str, int] = {}  # layer-wise transfers: positions before this were pushed
        self._pieces: list[_Piece] = []  # this step's
        self._failures: list[tuple[str, TransferError]] = []
        self._pushed: dict[str, TransferTicket] = {}  # this step's pushes
        self._first_push = 0.0  # when the first of them began (set with `_pushed`'s first entry)
        self._sending: list[_Sending] = []  # steps whose pushes have not all left, oldest first
        self.stream_seconds = 0.0  # last step: time the compute thread spent packing and pushing layers
        self.bytes_pushed = 0      # KV bytes pushed by rank 0, ever
        self._transfers: list[TransferStats] = []  # steps whose pushes have all left, since `take_transfers`

    def add(self, ticket: TransferTicket, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None) -> None:
        """Raises IncompatibleKV (before any work) when the ticket's token worker holds another
        layout, and TransferError when it gave a direct transfer up already."""
        self.transport.check_compatible(ticket)
        try:
            for part in self._own(ticket):
                self.transport.claim(part)
        except TransferError:
            self._release(ticket)
            raise
        self.engine.add_request(ticket.request_id, prompt_token_ids, params, arrival_time, hand_off=True,
                                export_from=ticket.starts(self.engine.block_manager.num_groups))
        self._tickets[ticket.request_id] = ticket
        self._deadlines[ticket.request_id] = time.monotonic() + self.lease_s

    def step(self) -> list[RequestOutput]:
        """One prefill iteration with layer-wise pushes; returns outputs carrying first tokens.
        Never waits for pushes to leave: earlier steps' are looked at (`reap`) before and after."""
        self._expire_leases()
        self.reap()
        self.stream_seconds = 0.0
        outputs = self.engine.step(after_layer=self._after_layer,  # no transfers here: nothing to look for
                                   before_forward=self._before_forward if self._tickets else None)
        self._pieces = []
        for out in outputs:
            if out.request_id in self._tickets:
                self._hand_off(out)
        if self._pushed:  # (with any pushed between steps: an abort's CANCEL)
            self._sending.append(_Sending(self._pushed, self._first_push, self.stream_seconds))
            self._pushed = {}
        if self.leader is not None and self.leader.has_commands:
            self.leader.sync()  # the other ranks finish their hand-offs now, not at the next prefill
        self.reap()
        for request_id, _ in self._failures:  # freed only now: never in the middle of a forward pass
            self.engine.abort(request_id)
        return outputs

    def reap(self) -> None:
        """Without waiting: a broken peer fails every request pushed to it still in flight; a step
        whose pushes have all left gets its TransferStats (visible: the compute thread's time
        packing and pushing; span: from its first push until all had left)."""
        for error in self.transport.reap():
            failed = {r: error for sending in self._sending for r, t in sending.tickets.items()
                      if any(p.token_peer == error.peer for p in parts_of(t))}  # a chunked prompt's: in several
            known = {r for r, _ in self._failures}
            for request_id in (r for r in failed if r not in known):
                self._fail(request_id, error)  # a prefill still in chunks pushes no more
        while self._sending and self.transport.all_sent(
                {p.token_peer for t in self._sending[0].tickets.values() for p in self._own(t)}):
            sending = self._sending.pop(0)
            self._transfers.append(TransferStats(sending.visible_seconds, time.perf_counter() - sending.first_push))

    def take_transfers(self) -> list[TransferStats]:
        """The steps whose pushes have all left since the last call."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def abort(self, request_id: str) -> None:
        ticket = self._forget(request_id)
        self.engine.abort(request_id)
        if ticket is not None:
            self._cancel(ticket)

    def forget_peers(self, peers: frozenset[str]) -> None:
        """Peers that left the cluster for good: every rank's transport lets go of them."""
        self.transport.forget_peers(peers)
        for rank in range(1, self.leader.group.size if self.leader is not None else 1):
            self.leader.post(rank, ForgetPeers(peers))

    def failures(self) -> list[tuple[str, TransferError]]:
        """Requests whose transfer failed since the last call (their blocks are already freed)."""
        failures, self._failures = self._failures, []
        return failures

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            ticket = self._tickets[request_id]
            self.abort(request_id)
            self.leases_expired += 1
            self._failures.append((request_id, TransferError(
                ticket.token_peer, f"lease expired: not prefilled and handed off within {self.lease_s:g} s")))

    def _before_forward(self, plan: Plan) -> None:
        """This step's pieces of layer-wise transfers (the positions it computes, and any before
        them not pushed yet: a prefix hit's, a smaller step's), which the other ranks push too."""
        self._pieces = []
        num_groups, cache = self.engine.block_manager.num_groups, self.engine.kv_cache
        for item in plan.scheduled:
            ticket = self._tickets.get(item.seq.seq_id)
            end = item.start + item.num_new_tokens
            pushed = self._pushed_to.get(item.seq.seq_id, 0)
            if ticket is None or not ticket.layerwise or end - pushed < (1 if item.samples else self.min_piece_tokens):
                continue  # (end <= pushed: a recompute of pushed positions)
            self._pushed_to[ticket.request_id] = end
            span = Span(tuple(min(max(start, pushed), end) for start in ticket.starts(num_groups)), end)
            if all(start == end for start in span.starts):  # every group sends from later on
                continue
            tables = self.engine.block_manager.block_tables(ticket.request_id)
            host = slot_index(tables, cache.block_size, end, torch.device("cpu"), span.starts)
            self._pieces.append(_Piece(ticket, tuple(group.to(cache.data.device) for group in host), host, span))
        if self.leader is None:
            return
        by_rank: dict[int, list] = {}
        for piece in self._pieces:
            slots = as_lists(piece.host_slots)
            for part in parts_of(piece.ticket):
                if part.prompt_rank:
                    by_rank.setdefault(part.prompt_rank, []).append((part, slots, piece.span))
        for rank, parts in by_rank.items():
            self.leader.post(rank, PushLayers(parts))

    def _after_layer(self, plan: Plan, layer: int) -> None:
        start = time.perf_counter()
        for piece in self._pieces:
            ticket = piece.ticket
            if self._tickets.get(ticket.request_id) is ticket:  # not failed at an earlier layer
                for part in self._own(ticket):
                    self._try(ticket, lambda: self.rank.push_layer(part, layer, piece.slots, piece.span))
        self.stream_seconds += time.perf_counter() - start

    def _hand_off(self, out: RequestOutput) -> None:
        ticket = self._tickets[out.request_id]
        if out.finished:  # the first token already ended it (EOS, max_tokens=1): nothing to decode
            self._forget(ticket.request_id)
            self._cancel(ticket)
            return
        slots = () if ticket.layerwise else self._whole_slots(ticket)
        self._forget(ticket.request_id)
        for part in parts_of(ticket):
            if part.prompt_rank:
                self.leader.post(part.prompt_rank, FinishExport(part, as_lists(slots)))
            else:
                if not part.layerwise:
                    self._try(ticket, lambda: self.rank.push_all(part, slots))
                self._try(ticket, lambda: self.transport.complete(part, out.token_ids[0]))
        self.engine.release_request(ticket.request_id)

    def _cancel(self, ticket: TransferTicket) -> None:
        """Rank 0's parts say CANCEL; part (0 -> 0) among them makes the token side drop every part.
        The other ranks' direct parts say it too (`_release`)."""
        for part in self._own(ticket):
            self._try(ticket, lambda: self.transport.cancel(part))
        self._release(ticket)

    def _release(self, ticket: TransferTicket) -> None:
        """The export ended without a hand-off: each direct part a rank claimed says CANCEL, or the
        token side holds its blocks while that rank's link lives (the other ranks': next round)."""
        for part in parts_of(ticket):
            if part.prompt_rank:
                self.leader.post(part.prompt_rank, CancelExport(part))
            else:
                with contextlib.suppress(TransferError):  # its link failed: that released it
                    self.transport.release(part)

    def _take_reports(self, reports: list[RankReport]) -> None:
        for report in reports:
            for part, error in report.push_failures:
                if self._tickets.get(part.request_id) is not None:
                    self._fail(part.request_id, error)

    @staticmethod
    def _own(ticket: TransferTicket) -> list[TransferTicket]:
        return [part for part in parts_of(ticket) if part.prompt_rank == 0]

    def _whole_slots(self, ticket: TransferTicket) -> Slots:
        tables, cache = self.engine.block_manager.block_tables(ticket.request_id), self.engine.kv_cache
        return slot_index(tables, cache.block_size, ticket.num_tokens, cache.data.device, ticket.starts(len(tables)))

    def _forget(self, request_id: str) -> TransferTicket | None:
        self._pushed_to.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        return self._tickets.pop(request_id, None)

    def _fail(self, request_id: str, error: TransferError) -> None:
        """Its blocks are freed after the step; its other parts are released now."""
        self._failures.append((request_id, error))
        ticket = self._forget(request_id)
        if ticket is not None:
            self._release(ticket)

    def _try(self, ticket: TransferTicket, push) -> None:
        """A failed push fails only its own request: recorded here, its blocks freed after the step."""
        started = time.perf_counter()
        try:
            self.bytes_pushed += push() or 0
        except TransferError as error:
            self._fail(ticket.request_id, error)
            return
        if not self._pushed:
            self._first_push = started
        self._pushed[ticket.request_id] = ticket
