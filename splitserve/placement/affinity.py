"""Prefix- and LoRA-aware placement: what a request's cached prefix saves on each worker holding
some of it, less what its LoRA adapter costs where no slot holds it; and the searches that weigh
both (on top of base.py's blind ones).

A worker's score is its queue as the blind searches see it, less its net saving:
- a prompt worker saves the prefill of the cached tokens: `prefill_saved_weight` x tokens / its
  prompt speed, in prompt-queue units;
- a token worker saves receiving their KV: `transfer_saved_weight` x tokens, in token-queue units;
- a worker running the whole request (a mixed worker, or a guest moving in) saves the prefill and
  needs no transfer; one only decoding it saves the transfer (both in `base.combined_load`);
- a worker whose slots do not hold the request's adapter pays `AdapterOptions.swap_share` (an idle
  slot takes it) or `wait_share` (none is idle) of the side's overflow threshold, so of 1 in
  `combined_load` units: adapters gather where they are held, until the queues differ by more.
A pair's score is its prompt side's plus its token side's, so the best pair is the best prompt
worker with the best token worker: no search over pairs.

Eligibility is the blind rules (backpressure, KV room, the caller's caps), so affinity beats a
slightly shorter queue but never makes an overloaded worker eligible; a prompt cap (splitwise's
threshold) bounds the queue the request meets there, the worker's less its prefix saving
(`prompt_queue_for`), which the blind choice, under the cap, meets too. The KV room check still
counts the whole prompt: a worker's free KV includes its cached blocks no request holds, and
reusing them takes them out of it.
Savings are >= 0 and only holders have any, and an adapter costs by tier (held, an idle slot, a
wait), so the best candidate is the blind search's choice, a prefix holder, a worker holding the
adapter, or, where the blind choice would wait, one with an idle slot: any other has no saving,
costs at least as much and queues at least as long. Each search below starts from the blind
choice and makes one pass over those (`Affinity.candidates`, from the prefix and adapter indexes).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.placement.base import can_decode, can_prompt, can_run_whole, combined_load, least_loaded_whole
from splitserve.placement.state import (
    AdapterOptions,
    PlacementRequest,
    PlacementThresholds,
    PrefixOptions,
    Role,
    WorkerState,
)

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState


@dataclass(frozen=True, slots=True)
class Affinity:
    cached: dict[str, int]  # per worker holding the prompt's first block: the tokens of its cached prefix
    prefix: PrefixOptions
    thresholds: PlacementThresholds
    lora: str | None = None  # the request's adapter identity, where placement weighs adapter slots
    adapters: AdapterOptions = AdapterOptions()

    def prefill(self, worker: WorkerState) -> float:
        """Prompt-queue units saved on a worker prefilling the request (< 0: it costs)."""
        return self.prefix_saving(worker) - self._adapter_share(worker) * self.thresholds.mixed_prompt_tokens

    def prefix_saving(self, worker: WorkerState) -> float:
        """Prompt-queue units the request's cached prefix saves on a worker prefilling it."""
        return self.prefix.prefill_saved_weight * self.cached.get(worker.worker_id, 0) / worker.hardware.prompt_speed

    def transfer(self, worker: WorkerState) -> float:
        """Token-queue units saved on a worker decoding the request (< 0: it costs)."""
        cached = self.prefix.transfer_saved_weight * self.cached.get(worker.worker_id, 0)
        return cached - self._adapter_share(worker) * self.thresholds.mixed_decode_tokens

    def candidates(self, state: ClusterState, pool: Role, blind: WorkerState | None) -> list[WorkerState]:
        """The workers of `pool` that may score better than `blind`, the least queue."""
        ids = self.cached.keys()
        if self.lora is not None:
            ids = {*ids, *state.adapter_index.holders(self.lora)}
            if blind is not None and blind.adapter_wait(self.lora) == 2:
                ids |= state.adapter_index.idle
        workers = (state.workers.get(worker_id) for worker_id in ids)
        return [w for w in workers if w is not None and w.pool is pool]

    def _adapter_share(self, worker: WorkerState) -> float:
        """The share of a threshold the request's adapter costs on `worker` (`WorkerState.adapter_wait`)."""
        wait = worker.adapter_wait(self.lora)
        return 0.0 if wait == 0 else self.adapters.swap_share if wait == 1 else self.adapters.wait_share


def prompt_queue_for(worker: WorkerState, affinity: Affinity | None) -> float:
    """A prompt worker's queue as a request sees it: less what its cached prefix saves there."""
    return worker.prompt_queue() - (0.0 if affinity is None else affinity.prefix_saving(worker))


def prefer_affine_prompt(state: ClusterState, blind: WorkerState | None, affinity: Affinity,
                         exclude: frozenset[str], cap: float = math.inf) -> WorkerState | None:
    """The prompt worker to use instead of `blind` (the least queue), among those whose queue for
    the request (`prompt_queue_for`) is <= `cap`."""
    thresholds = state.thresholds
    return _least(blind, affinity.candidates(state, Role.PROMPT, blind),
                  lambda w: w.prompt_queue() - affinity.prefill(w),
                  lambda w: can_prompt(w, thresholds, exclude) and prompt_queue_for(w, affinity) <= cap)


def prefer_affine_token(state: ClusterState, blind: WorkerState | None, affinity: Affinity, request: PlacementRequest,
                        exclude: frozenset[str], cap: float = math.inf) -> WorkerState | None:
    """The token worker to use instead of `blind` (the least queue), among those queued <= `cap`."""
    thresholds = state.thresholds
    return _least(blind, affinity.candidates(state, Role.TOKEN, blind),
                  lambda w: w.token_queue() - affinity.transfer(w),
                  lambda w: can_decode(w, thresholds, request, exclude) and w.token_queue() <= cap)


def least_loaded_affine(state: ClusterState, pool: Role, request: PlacementRequest, exclude: frozenset[str],
                        affinity: Affinity | None, decode_only: bool = False, prompt_cap: float = math.inf,
                        token_cap: float = math.inf) -> WorkerState | None:
    """`base.least_loaded_whole` over `pool` with what `affinity` saves (None: blind) for a worker
    running the whole request, or with `decode_only` only decoding it (an adapter's cost counts
    once either way)."""
    thresholds = state.thresholds
    blind = least_loaded_whole(state.members(pool), thresholds, request, exclude, prompt_cap, token_cap)
    if affinity is None:
        return blind
    if decode_only:
        def score(w: WorkerState) -> float:
            return combined_load(w, thresholds, saved_token=affinity.transfer(w))
    else:
        def score(w: WorkerState) -> float:
            return combined_load(w, thresholds, saved_prompt=affinity.prefill(w))
    return _least(blind, affinity.candidates(state, pool, blind), score,
                  lambda w: can_run_whole(w, thresholds, request, exclude)
                  and w.prompt_queue() <= prompt_cap and w.token_queue() <= token_cap)


def _least(blind: WorkerState | None, candidates: list[WorkerState], score: Callable[[WorkerState], float],
           eligible: Callable[[WorkerState], bool]) -> WorkerState | None:
    """The least (score, id) among `blind` and the eligible candidates. No blind choice: no eligible
    worker at all, candidates included."""
    if blind is None:
        return None
    best, best_key = blind, (score(blind), blind.worker_id)
    for worker in candidates:
        key = (score(worker), worker.worker_id)
        if key < best_key and eligible(worker):
            best, best_key = worker, key
    return best
