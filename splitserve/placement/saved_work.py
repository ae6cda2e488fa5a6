"""Prefix-aware placement: the work a request's cached prefix saves on each worker that holds
some of it, and the searches that weigh it (on top of base.py's blind ones).

A worker's score is its queue as the blind searches see it, less what its cached prefix saves:
- a prompt worker saves the prefill of the cached tokens: `prefill_saved_weight` x tokens / its
  prompt speed, in prompt-queue units;
- a token worker saves receiving their KV: `transfer_saved_weight` x tokens, in token-queue units;
- a worker running the whole request (a mixed worker, or a guest moving in) saves the prefill and
  needs no transfer; one only decoding it saves the transfer (both in `base.combined_load`).
A pair's score is its prompt side's plus its token side's, so the best pair is the best prompt
worker with the best token worker: no search over pairs.

Eligibility is exactly the blind rules (backpressure, KV room, the caller's caps): a cached prefix
reorders candidates, it never admits one, so it beats a slightly shorter queue but never makes an
overloaded worker eligible. The KV room check still counts the whole prompt: a worker's free KV
includes its cached blocks no request holds, and reusing them takes them out of it.
Savings are >= 0 and only holders have any, so the best candidate is the blind search's choice or
a holder: each search below starts from the blind choice and makes one pass over the holders.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.placement.base import can_decode, can_prompt, can_run_whole, combined_load, least_loaded_whole
from splitserve.placement.state import PlacementRequest, PrefixOptions, Role, WorkerState

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState


@dataclass(frozen=True, slots=True)
class SavedWork:
    cached: dict[str, int]  # per worker holding the prompt's first block: the tokens of its cached prefix
    options: PrefixOptions

    def prefill(self, worker: WorkerState) -> float:
        return self.options.prefill_saved_weight * self.cached.get(worker.worker_id, 0) / worker.hardware.prompt_speed

    def transfer(self, worker: WorkerState) -> float:
        return self.options.transfer_saved_weight * self.cached.get(worker.worker_id, 0)

    def holders(self, state: ClusterState, pool: Role) -> list[WorkerState]:
        workers = (state.workers.get(worker_id) for worker_id in self.cached)
        return [w for w in workers if w is not None and w.pool is pool]


def prefer_cached_prompt(state: ClusterState, blind: WorkerState | None, saved: SavedWork,
                         exclude: frozenset[str], cap: float = math.inf) -> WorkerState | None:
    """The prompt worker to use instead of `blind` (the least queue), among those queued <= `cap`."""
    thresholds = state.thresholds
    return _least(blind, saved.holders(state, Role.PROMPT), lambda w: w.prompt_queue() - saved.prefill(w),
                  lambda w: can_prompt(w, thresholds, exclude) and w.prompt_queue() <= cap)


def prefer_cached_token(state: ClusterState, blind: WorkerState | None, saved: SavedWork, request: PlacementRequest,
                        exclude: frozenset[str], cap: float = math.inf) -> WorkerState | None:
    """The token worker to use instead of `blind` (the least queue), among those queued <= `cap`."""
    thresholds = state.thresholds
    return _least(blind, saved.holders(state, Role.TOKEN), lambda w: w.token_queue() - saved.transfer(w),
                  lambda w: can_decode(w, thresholds, request, exclude) and w.token_queue() <= cap)


def least_loaded_saving(state: ClusterState, pool: Role, request: PlacementRequest, exclude: frozenset[str],
                        saved: SavedWork | None, decode_only: bool = False, prompt_cap: float = math.inf,
                        token_cap: float = math.inf) -> WorkerState | None:
    """`base.least_loaded_whole` over `pool` with what `saved` saves (None: blind) for a worker
    running the whole request, or with `decode_only` only decoding it."""
    thresholds = state.thresholds
    blind = least_loaded_whole(state.members(pool), thresholds, request, exclude, prompt_cap, token_cap)
    if saved is None:
        return blind
    if decode_only:
        def score(w: WorkerState) -> float:
            return combined_load(w, thresholds, saved_token=saved.transfer(w))
    else:
        def score(w: WorkerState) -> float:
            return combined_load(w, thresholds, saved_prompt=saved.prefill(w))
    return _least(blind, saved.holders(state, pool), score,
                  lambda w: can_run_whole(w, thresholds, request, exclude)
                  and w.prompt_queue() <= prompt_cap and w.token_queue() <= token_cap)


def _least(blind: WorkerState | None, holders: list[WorkerState], score: Callable[[WorkerState], float],
           eligible: Callable[[WorkerState], bool]) -> WorkerState | None:
    """The least (score, id) among `blind` and the eligible holders. No blind choice: no eligible
    worker at all, holders included."""
    if blind is None:
        return None
    best, best_key = blind, (score(blind), blind.worker_id)
    for worker in holders:
        key = (score(worker), worker.worker_id)
        if key < best_key and eligible(worker):
            best, best_key = worker, key
    return best
