"""The placement-policy interface and the eligibility rules and searches every policy shares.

Queues are speed-weighted pending tokens (`WorkerState.prompt_queue` / `token_queue`). A worker is
- a prompt candidate: not excluded and prompt queue < `max_queue_tokens` (backpressure);
- a token candidate: not excluded, token queue < `max_decode_queue_tokens`, and room in its KV cache
  for the prompt plus the first token (skipped while it has never reported its KV capacity);
- a whole-request (local) candidate: both at once.
Searches scan workers in id order (the pools keep them sorted) and keep the first strict minimum, so
ties go to the lowest id and every decision is deterministic. Each is one pass, no lists built.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve.placement.state import Placement, PlacementRequest, PlacementThresholds, PoolMove, Role, WorkerState

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState

Decision = tuple[Placement | None, list[PoolMove]]  # moves: a fresh list each time (callers may extend it)


class PlacementPolicy(ABC):
    """Chooses the workers of each request; one instance per `ClusterState` (it may keep cursors)."""

    name: str

    @abstractmethod
    def choose(self, state: ClusterState, request: PlacementRequest, now: float,
               exclude: frozenset[str]) -> Decision:
        """Placement (None: cannot admit now) and the pool moves it needs; the state applies both."""

    @abstractmethod
    def choose_prompt_only(self, state: ClusterState, request: PlacementRequest, now: float,
                           exclude: frozenset[str]) -> Decision:
        """`choose` for a `request.prompt_only` one: whole on a prompt worker where one qualifies,
        so it needs no token worker's room and sends no KV."""

    def rebalance(self, state: ClusterState, now: float, reporter: WorkerState) -> list[PoolMove]:
        """Pool moves to make after `reporter`'s report; by default pools never change."""
        return []


def has_kv_room(worker: WorkerState, tokens: int) -> bool:
    """Whether a sequence of `tokens` tokens fits in the worker's free KV (as it last reported, less
    what was placed on it since)."""
    return worker.load.total_kv_tokens == 0 or worker.free_kv_tokens() >= worker.load.kv_tokens(tokens)


def can_prompt(worker: WorkerState, thresholds: PlacementThresholds, exclude: frozenset[str]) -> bool:
    return worker.prompt_queue() < thresholds.max_queue_tokens and worker.worker_id not in exclude


def has_import_room(worker: WorkerState, request: PlacementRequest) -> bool:
    """Whether the worker's free KV takes the request's prompt and first token as an import
    (`WorkerLoad.import_tokens`: a windowed model's growth headroom too)."""
    load = worker.load
    return load.total_kv_tokens == 0 or worker.free_kv_tokens() >= load.import_tokens(request.num_prompt_tokens + 1,
                                                                                       request.max_tokens)


def can_decode(worker: WorkerState, thresholds: PlacementThresholds, request: PlacementRequest,
               exclude: frozenset[str]) -> bool:
    """The token side of a pair: room in its token queue and for the import, and no sequence waits
    there after a preemption (the worker takes no import until they run again: `Policy.reserve_import`)."""
    return (worker.token_queue() < thresholds.max_decode_queue_tokens and has_import_room(worker, request)
            and worker.worker_id not in exclude and worker.load.num_preempted == 0)


def can_run_whole(worker: WorkerState, thresholds: PlacementThresholds, request: PlacementRequest,
                  exclude: frozenset[str]) -> bool:
    """Both queues have room, and its free KV the prompt and first token (no import: no headroom)."""
    return (can_prompt(worker, thresholds, exclude) and worker.token_queue() < thresholds.max_decode_queue_tokens
            and has_kv_room(worker, request.num_prompt_tokens + 1))


def combined_load(worker: WorkerState, thresholds: PlacementThresholds, saved_prompt: float = 0.0,
                  saved_token: float = 0.0) -> float:
    """Load of a worker running whole requests: each queue as a fraction of its overflow threshold,
    summed. A decode token of context costs far less than a prompt token to compute (65536 vs 2048
    by default), so raw token counts would let the decode side swamp the prompt side. `saved_*`:
    what a request's cached prefix saves there, off each queue (affinity.py)."""
    return ((worker.prompt_queue() - saved_prompt) / thresholds.mixed_prompt_tokens
            + (worker.token_queue() - saved_token) / thresholds.mixed_decode_tokens)


# The scans below inline WorkerState.prompt_queue / token_queue / free_kv_tokens and the eligibility
# rules above: they are the per-decision hot path (up to 3 x 512 workers), and method calls would
# triple their cost. tests/placement/test_placement_rules.py checks them against the readable versions.
def least_prompt_queue(workers: Sequence[WorkerState], thresholds: PlacementThresholds,
                       exclude: frozenset[str]) -> WorkerState | None:
    best, best_queue = None, thresholds.max_queue_tokens
    for worker in workers:
        queue = (worker.load.pending_prompt_tokens + worker.placed_prompt_tokens) / worker.hardware.prompt_speed
        if queue < best_queue and worker.worker_id not in exclude:
            best, best_queue = worker, queue
    return best


def least_token_queue(workers: Sequence[WorkerState], thresholds: PlacementThresholds, request: PlacementRequest,
                      exclude: frozenset[str]) -> WorkerState | None:
    best, best_queue = None, thresholds.max_decode_queue_tokens
    kv_needed, max_tokens = request.num_prompt_tokens + 1, request.max_tokens
    for worker in workers:
        load = worker.load
        queue = (load.decode_tokens + worker.placed_decode_tokens) / worker.hardware.token_speed
        if (queue < best_queue and worker.worker_id not in exclude and not load.num_preempted
                and (load.total_kv_tokens == 0 or load.free_kv_tokens - worker.placed_kv_tokens
                     >= (load.import_tokens(kv_needed, max_tokens) if load.kv_window_tokens else kv_needed))):
            best, best_queue = worker, queue
    return best


def least_loaded_whole(workers: Sequence[WorkerState], thresholds: PlacementThresholds, request: PlacementRequest,
                       exclude: frozenset[str], prompt_cap: float = math.inf,
                       token_cap: float = math.inf) -> WorkerState | None:
    """The whole-request candidate with the least `combined_load` whose queues are within the caps."""
    best, best_load = None, math.inf
    kv_needed = request.num_prompt_tokens + 1
    # queue < bound <=> queue below the backpressure limit and at most the cap
    prompt_bound = min(thresholds.max_queue_tokens, math.nextafter(prompt_cap, math.inf))
    token_bound = min(thresholds.max_decode_queue_tokens, math.nextafter(token_cap, math.inf))
    prompt_scale, token_scale = 1 / thresholds.mixed_prompt_tokens, 1 / thresholds.mixed_decode_tokens
    for worker in workers:
        load, placed_decode = worker.load, worker.placed_decode_tokens
        prompt_queue = (load.pending_prompt_tokens + worker.placed_prompt_tokens) / worker.hardware.prompt_speed
        token_queue = (load.decode_tokens + placed_decode) / worker.hardware.token_speed
        combined = prompt_queue * prompt_scale + token_queue * token_scale
        if (combined < best_load and prompt_queue < prompt_bound and token_queue < token_bound
                and worker.worker_id not in exclude
                and (load.total_kv_tokens == 0 or load.free_kv_tokens - worker.placed_kv_tokens
                     >= (load.kv_tokens(kv_needed) if load.kv_window_tokens else kv_needed))):
            best, best_load = worker, combined
    return best


def mixed_only(state: ClusterState) -> bool:
    """No prompt or token pool: the non-disaggregated baseline, every request runs whole."""
    return not state.members(Role.PROMPT) and not state.members(Role.TOKEN)


def run_whole_on(worker: WorkerState | None) -> Decision:
    return (None, []) if worker is None else (Placement(worker.worker_id, worker.worker_id), [])
