"""The token worker's side of a handoff (`KVImporter`): reserves blocks and issues the ticket, lands
every part, and joins the request to the decode batch with its first token. The whole
protocol: `handoff`."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import as_lists, slot_index
from splitserve.transfer.handoff import LAYERWISE_THRESHOLD
from splitserve.transfer.kv_routes import split_ticket
from splitserve.transfer.link import TransferError
from splitserve.transfer.rank_commands import Abandon, Expect, RankReport
from splitserve.transfer.rank_kv import RankKV
from splitserve.transfer.transport import KVTransport, TransferTicket


def _route(part: TransferTicket) -> tuple[int, int]:
    """A part within its transfer (parts of one transfer may share a tag on different token ranks)."""
    return part.prompt_rank, part.token_rank


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
        seq, tables = self.engine.reserve_import(request_id, prompt_token_ids, params, arrival_time,
                                                 self.reuse_prefix)
        start = seq.num_computed_tokens  # held here already (prefix cache); never the last token
        starts = self.engine.block_manager.held_from(seq)
        slots = slot_index(tables, cache.block_size, num_tokens, torch.device("cpu"), starts)  # (RankKV.expect)
        group_of = cache.groups.group_of  # a layer's tokens travel from its group's start: the threshold is their mean
        layerwise = sum(num_tokens - starts[group] for group in group_of) >= self.layerwise_threshold * len(group_of)
        ticket = TransferTicket(request_id, next(self._tags), prompt_peer, self.worker_id, num_tokens, layerwise,
                                self.transport.layout, start, group_starts=starts)
        parts = split_ticket(ticket, self.engine.model_config.num_key_value_heads, prompt_tp, self.tp_size)
        stamped = []
        for part in parts:
            if part.token_rank:
                self.leader.post(part.token_rank, Expect(part, as_lists(slots), tables))
            else:
                stamped.append(self.rank.expect(part, slots, tables))
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
