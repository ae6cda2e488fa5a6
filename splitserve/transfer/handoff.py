"""Engine glue for disaggregation: the prompt worker exports, the token worker imports.

Prompt worker (`KVExporter`, an engine in any role; requests added through it are handed off):
while a prompt's prefill runs, each layer's KV is packed and pushed as soon as that layer has
written it (the push is asynchronous, so layer i + 1 computes while layer i travels); prompts
under the threshold go in one push after the prefill. Then the first token is pushed and the
prompt engine frees the request: the pushed KV is a copy, so the blocks are free at once. The
next step does not wait for those pushes to leave: a peer that stops reading fails its link
after the transport's timeout.

Token worker (`KVImporter`): reserves blocks before the prefill starts and issues the ticket the
prompt worker pushes against; layers land straight in those blocks; the request joins the
decode batch when the completion (first token) arrives. A failed or cancelled transfer frees the
reserved blocks (a direct transfer's once its sender has stopped writing into them: see
transport). With `reuse_prefix` the reservation goes through the token worker's prefix cache:
the cached full blocks of the prompt's prefix (an earlier turn of the conversation, say) are
shared, and the ticket's `start_token` asks for the KV of the positions after them only; the
prompt worker packs and pushes just those (the layer-wise threshold counts them alone).

Tensor parallelism: a transfer travels as parts, one per (prompt rank, token rank) route
(`kv_routes`); each rank pushes or lands its own KV heads (`RankKV`). Rank 0 runs everything
here and sends the other ranks commands with its engine's rounds (`rank_commands`, run there by
`FollowerKV`); their reports come back with the round. An import completes when every part has
landed and fails when one fails (the others are abandoned). The exporter's stats time rank 0's pushes.

Leases: no KV is stranded. A reservation that has not completed `lease_s` after it was made
(prompt worker stalled or dead, ingress gone before the prefill was asked for) is abandoned and
its blocks freed; a prefill not handed off `lease_s` after it was added is aborted on the prompt
side and cancelled towards the token side. Each side enforces its own lease, so neither depends
on the other being alive.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.policies import Plan
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import slot_index, wire_shape
from splitserve.transfer.kv_routes import split_ticket
from splitserve.transfer.link import Fabric, TransferError
from splitserve.transfer.rank_commands import Abandon, Expect, FinishExport, PushLayers, RankReport
from splitserve.transfer.rank_kv import RankKV
from splitserve.transfer.transport import KVTransport, TransferTicket

LAYERWISE_THRESHOLD = 512  # tokens whose KV travels; below it one transfer after the prefill (Splitwise IV-C)


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


def kv_layout(engine) -> str:
    """What must match for one engine's KV to be another's: the model (name and a hash of its
    config, and the weights' seed where they are dummy), the KV dtype (fp8_e4m3 for an FP8 cache)
    and the per-token layout of the whole model. Not the block size (the wire is token-major, so
    the two caches may page differently), nor the TP size (parts carry each rank its own heads).
    `engine`: an LLMEngine or a TPFollower."""
    config, model = engine.config, engine.model_config
    identity = json.dumps([engine.model_name, dataclasses.asdict(model), config.load_format,
                           config.seed if config.load_format == "dummy" else None], sort_keys=True, default=str)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return (f"model={engine.model_name} config={digest} dtype={engine.kv_cache.encoding} "
            f"layers={model.num_hidden_layers} kv_heads={model.num_key_value_heads} head_dim={model.head_dim}")


def make_transport(engine, fabric: Fabric, timeout: float = 60.0) -> KVTransport:
    """A rank's transport (`engine`: an LLMEngine or a TPFollower)."""
    cache = engine.kv_cache
    return KVTransport(fabric, lambda n, heads: wire_shape(cache, n, heads=heads), cache.data.shape[0],
                       cache.data.dtype, cache.data.device, timeout, kv_layout(engine), engine.max_model_len,
                       cache.data.shape[-2])


def _route(part: TransferTicket) -> tuple[int, int]:
    """A part within its transfer (parts of one transfer may share a tag on different token ranks)."""
    return part.prompt_rank, part.token_rank


def parts_of(ticket: TransferTicket) -> tuple[TransferTicket, ...]:
    """A ticket made without parts (by hand, in tests) is its own one part."""
    return ticket.parts or (ticket,)


@dataclass(frozen=True)
class _Sending:
    tickets: dict[str, TransferTicket]
    first_push: float
    visible_seconds: float


class KVExporter:
    def __init__(self, engine: LLMEngine, transport: KVTransport, lease_s: float = float("inf")):
        self.engine, self.transport, self.lease_s = engine, transport, lease_s
        self.rank = RankKV(transport, engine.kv_cache, engine.model_config.num_key_value_heads)
        self.leader = engine.tp_leader
        if self.leader is not None:
            self.leader.listeners.append(self._take_reports)
        self._deadlines: dict[str, float] = {}
        self.leases_expired = 0
        self._tickets: dict[str, TransferTicket] = {}
        self._slots: dict[str, torch.Tensor] = {}
        self._failures: list[tuple[str, TransferError]] = []
        self._pushed: dict[str, TransferTicket] = {}  # this step's pushes
        self._sending: list[_Sending] = []  # steps whose pushes have not all left, oldest first
        self.stream_seconds = 0.0  # last step: time the compute thread spent packing and pushing layers
        self.bytes_pushed = 0      # KV bytes pushed by rank 0, ever
        self._transfers: list[TransferStats] = []  # steps whose pushes have all left, since `take_transfers`
        self._first_push: float | None = None

    def add(self, ticket: TransferTicket, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None) -> None:
        """Raises IncompatibleKV (before any work) when the ticket's token worker holds another
        layout, and TransferError when it gave a direct transfer up already."""
        self.transport.check_compatible(ticket)
        for part in self._own(ticket):
            self.transport.claim(part)
        self.engine.add_request(ticket.request_id, prompt_token_ids, params, arrival_time, hand_off=True)
        self._tickets[ticket.request_id] = ticket
        self._deadlines[ticket.request_id] = time.monotonic() + self.lease_s

    def step(self) -> list[RequestOutput]:
        """One prefill iteration with layer-wise pushes; returns outputs carrying first tokens.
        Never waits for pushes to leave: earlier steps' are looked at (`reap`) before and after."""
        self._expire_leases()
        self.reap()
        self.stream_seconds, self._first_push = 0.0, None
        outputs = self.engine.step(after_layer=self._after_layer,
                                   before_forward=self._before_forward if self.leader is not None else None)
        for out in outputs:
            if out.request_id in self._tickets:
                self._hand_off(out)
        if self._pushed:
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
            for sending in self._sending:
                self._failures += [(r, error) for r, t in sending.tickets.items()
                                   if any(p.token_peer == error.peer for p in parts_of(t))]
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
        """Tell the other ranks which parts to push layer by layer in this step."""
        by_rank: dict[int, list] = {}
        for ticket in self._layerwise(plan):
            slots = self._slots_for(ticket).tolist()
            for part in parts_of(ticket):
                if part.prompt_rank:
                    by_rank.setdefault(part.prompt_rank, []).append((part, slots))
        for rank, parts in by_rank.items():
            self.leader.post(rank, PushLayers(parts))

    def _after_layer(self, plan: Plan, layer: int) -> None:
        start = time.perf_counter()
        for ticket in self._layerwise(plan):
            for part in self._own(ticket):
                self._try(ticket, lambda: self.rank.push_layer(part, layer, self._slots_for(ticket)))
        self.stream_seconds += time.perf_counter() - start

    def _layerwise(self, plan: Plan) -> list[TransferTicket]:
        """The layer-wise transfers this step completes the prefill of (pushed as its layers land)."""
        tickets = (self._tickets.get(item.seq.seq_id) for item in plan.scheduled if item.samples)
        return [t for t in tickets if t is not None and t.layerwise]

    def _hand_off(self, out: RequestOutput) -> None:
        ticket = self._tickets[out.request_id]
        if out.finished:  # the first token already ended it (EOS, max_tokens=1): nothing to decode
            self._forget(ticket.request_id)
            self._cancel(ticket)
            return
        slots = self._slots_for(ticket)
        self._forget(ticket.request_id)
        for part in parts_of(ticket):
            if part.prompt_rank:
                self.leader.post(part.prompt_rank, FinishExport(part, slots.tolist()))
            else:
                if not part.layerwise:
                    self._try(ticket, lambda: self.rank.push_all(part, slots))
                self._try(ticket, lambda: self.transport.complete(part, out.token_ids[0]))
        self.engine.release_request(ticket.request_id)

    def _cancel(self, ticket: TransferTicket) -> None:
        """Rank 0's parts say CANCEL; part (0 -> 0) among them makes the token side drop every part."""
        for part in self._own(ticket):
            self._try(ticket, lambda: self.transport.cancel(part))

    def _take_reports(self, reports: list[RankReport]) -> None:
        for report in reports:
            for part, error in report.push_failures:
                if self._tickets.get(part.request_id) is not None:
                    self._forget(part.request_id)
                    self._failures.append((part.request_id, error))

    @staticmethod
    def _own(ticket: TransferTicket) -> list[TransferTicket]:
        return [part for part in parts_of(ticket) if part.prompt_rank == 0]

    def _slots_for(self, ticket: TransferTicket) -> torch.Tensor:
        if ticket.request_id not in self._slots:
            table = self.engine.block_manager.block_table(ticket.request_id)
            self._slots[ticket.request_id] = slot_index(table, self.engine.kv_cache.block_size, ticket.num_tokens,
                                                        self.engine.kv_cache.data.device, ticket.start_token)
        return self._slots[ticket.request_id]

    def _forget(self, request_id: str) -> TransferTicket | None:
        self._slots.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        return self._tickets.pop(request_id, None)

    def _try(self, ticket: TransferTicket, push) -> None:
        """A failed push fails only its own request: recorded here, its blocks freed after the step."""
        try:
            if self._first_push is None:
                self._first_push = time.perf_counter()
            self.bytes_pushed += push() or 0
            self._pushed[ticket.request_id] = ticket
        except TransferError as error:
            self._failures.append((ticket.request_id, error))
            self._forget(ticket.request_id)


@dataclass
class _Import:
    ticket: TransferTicket
    waiting: set[tuple[int, int]]  # (prompt rank, token rank) of the parts not landed yet
    first_token: int | None = None


class KVImporter:
    def __init__(self, engine: LLMEngine, transport: KVTransport, worker_id: str,
                 layerwise_threshold: int = LAYERWISE_THRESHOLD, lease_s: float = float("inf"),
                 reuse_prefix: bool = True):
        """`reuse_prefix`: ask only for the KV this engine's prefix cache lacks (False: the whole prompt's)."""
        self.engine, self.transport, self.worker_id = engine, transport, worker_id
        self.layerwise_threshold, self.lease_s, self.reuse_prefix = layerwise_threshold, lease_s, reuse_prefix
        self.rank = RankKV(transport, engine.kv_cache, engine.model_config.num_key_value_heads)
        self.leader = engine.tp_leader
        self.tp_size = 1 if self.leader is None else self.leader.group.size
        if self.leader is not None:
            self.leader.listeners.append(self._take_reports)
        self._tags = itertools.count()
        self._imports: dict[str, _Import] = {}
        self._deadlines: dict[str, float] = {}
        self._stamped: dict[tuple, TransferTicket] = {}  # parts the other ranks stamped, by request and `_route`
        self._landed: list[tuple[TransferTicket, int | TransferError]] = []  # parts the other ranks landed
        self._released: list[TransferTicket] = []  # held parts the other ranks released
        self._held: dict[str, set[tuple[int, int]]] = {}  # given-up requests: direct parts still being written
        self._rounds_seen = 0
        self.leases_expired = 0
        self.kv_tokens_reused = 0  # prompt tokens of completed imports whose KV came from the prefix cache, ever

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt_peer: str,
                arrival_time: float | None = None, prompt_tp: int = 1) -> TransferTicket:
        """Reserve blocks for the prompt (raises OutOfBlocksError / EngineFullError when full);
        `prompt_tp` is the prompt worker's TP size (which of its ranks send which heads)."""
        cache, num_tokens = self.engine.kv_cache, len(prompt_token_ids)
        seq, block_ids = self.engine.reserve_import(request_id, prompt_token_ids, params, arrival_time,
                                                    self.reuse_prefix)
        start = seq.num_computed_tokens  # held here already (prefix cache); never the last token
        slots = slot_index(block_ids, cache.block_size, num_tokens, cache.data.device, start)
        ticket = TransferTicket(request_id, next(self._tags), prompt_peer, self.worker_id, num_tokens,
                                num_tokens - start >= self.layerwise_threshold, self.transport.layout, start)
        parts = split_ticket(ticket, self.engine.model_config.num_key_value_heads, prompt_tp, self.tp_size)
        stamped = []
        for part in parts:
            if part.token_rank:
                self.leader.post(part.token_rank, Expect(part, slots.tolist(), block_ids))
            else:
                stamped.append(self.rank.expect(part, slots, block_ids))
        if len(stamped) < len(parts):
            self.leader.sync()  # the other ranks stamp theirs
            stamped += [self._stamped.pop((request_id, *_route(part))) for part in parts if part.token_rank]
        ticket = dataclasses.replace(ticket, parts=tuple(stamped))
        self._imports[request_id] = _Import(ticket, {_route(part) for part in stamped})
        self._deadlines[request_id] = time.monotonic() + self.lease_s
        return ticket

    def poll(self, timeout: float = 0.0) -> tuple[list[RequestOutput], list[tuple[str, TransferError]]]:
        """Land finished transfers: completed ones start decoding, failed ones free their blocks.
        `timeout` > 0 waits for one when none has finished (for a worker with nothing to decode)."""
        landed, released = self.transport.poll(timeout), self.transport.take_released()
        if self.leader is not None:
            if self.leader.rounds == self._rounds_seen:
                self.leader.sync()  # no step since the last look: ask the other ranks
            self._rounds_seen = self.leader.rounds
            landed, self._landed = landed + self._landed, []
            released, self._released = released + self._released, []
        self._free_released(released)
        outputs, failures = [], []
        for part, result in landed:
            done = self._imports.get(part.request_id)
            if done is None or _route(part) not in done.waiting:  # cancelled, expired or failed meanwhile
                continue
            if isinstance(result, TransferError):
                self.cancel(part.request_id)
                failures.append((part.request_id, result))
                continue
            done.waiting.discard(_route(part))
            if part.prompt_rank == 0 and part.token_rank == 0:
                done.first_token = result
            if not done.waiting:
                self._drop(part.request_id)
                self.kv_tokens_reused += done.ticket.start_token
                outputs.append(self.engine.complete_import(part.request_id, done.first_token))
        return outputs, failures + self._expire_leases()

    def cancel(self, request_id: str) -> None:
        """Give a transfer up; its blocks are freed now, or, where a direct part's sender may still
        write into them, once it has stopped (the request is held until then)."""
        if request_id in self._held:
            return
        done = self._drop(request_id)
        held = set()
        for part in done.ticket.parts if done is not None else ():
            if _route(part) not in done.waiting:
                continue
            if part.token_rank:
                self.leader.post(part.token_rank, Abandon(part))
                if part.dest is not None:  # that rank reports it released
                    held.add(_route(part))
            elif not self.transport.abandon(part):
                held.add(_route(part))
        if held:
            self._held[request_id] = held
        else:
            self.engine.abort(request_id)

    @property
    def num_held(self) -> int:
        """Given-up requests whose blocks wait for a direct sender to stop writing."""
        return len(self._held)

    def _free_released(self, released: list[TransferTicket]) -> None:
        for part in released:
            held = self._held.get(part.request_id)
            if held is None:
                continue
            held.discard(_route(part))
            if not held:
                del self._held[part.request_id]
                self.engine.abort(part.request_id)

    def _take_reports(self, reports: list[RankReport]) -> None:
        for report in reports:
            self._stamped.update(((part.request_id, *_route(part)), part) for part in report.stamped)
            self._landed += report.landed
            self._released += report.released

    def _expire_leases(self) -> list[tuple[str, TransferError]]:
        now = time.monotonic()
        expired = []
        for request_id in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            ticket = self._imports[request_id].ticket
            self.cancel(request_id)
            expired.append((request_id, TransferError(
                ticket.prompt_peer, f"lease expired: the KV did not arrive within {self.lease_s:g} s")))
        self.leases_expired += len(expired)
        return expired

    def _drop(self, request_id: str) -> _Import | None:
        self._deadlines.pop(request_id, None)
        return self._imports.pop(request_id, None)
