"""Splitwise's cluster-level scheduling (IV-A): JSQ over the prompt and token pools, overflow into a
mixed pool when a pool's best queue passes its threshold, and coarse re-purposing of workers that
stay mixed for long.

Overflow, prompt side (the best prompt queue the request meets, less the prefill its cached prefix
saves there, > `mixed_prompt_tokens`, or no prompt candidate): run the request whole on the
least-loaded mixed worker whose prompt queue is within the threshold; failing that, move the
least-loaded token worker into the mixed pool and run it there. Token side (best token queue >
`mixed_decode_tokens`, or no candidate): decode on a mixed worker within that threshold (the KV
goes prompt worker -> mixed worker); failing that, move the least-loaded prompt worker into the
mixed pool to decode. A move may take a pool's last worker: a guest still does its home pool's
work with mixed batching, and an empty pool's requests overflow to the mixed pool. With no overflow target,
an over-threshold (but eligible) JSQ choice still serves; with no candidate at all, nothing does.
Mixed workers are picked by `base.combined_load`, since they batch prompts and decodes together.
Every choice weighs what a worker's cached prefix of the request saves and what its LoRA adapter
costs where no slot holds it (affinity.py), within the same thresholds, a prompt worker's taken net
of its saving (`affinity.prompt_queue_for`): a worker over a threshold the blind choice is under is
not preferred.

Rebalance (every report, of the reporting worker): a guest in the mixed pool goes home once it has no
work of the kind its home pool does not do. One that has stayed mixed for `repurpose_after_s` changes
home to the opposite pool and moves there (at most one such change per that period, cluster-wide,
and never the last worker of its home); its leftover work finishes there (the engine's prompt and
token policies both run leftovers of the other kind).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from splitserve.placement.base import Decision, least_prompt_queue, least_token_queue, mixed_only, run_whole_on
from splitserve.placement.jsq import JSQPolicy
from splitserve.placement.affinity import (
    Affinity,
    least_loaded_affine,
    prefer_affine_token,
    prompt_queue_for,
)
from splitserve.placement.state import Placement, PlacementRequest, PoolMove, Role, WorkerState

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState

OPPOSITE_POOL = {Role.PROMPT: Role.TOKEN, Role.TOKEN: Role.PROMPT}


def has_guest_work(worker: WorkerState) -> bool:
    """Whether a mixed-pool guest still holds work its home pool does not do."""
    if worker.home is Role.PROMPT:
        return worker.load.num_decoding > 0 or worker.placed_decode_tokens > 0
    return worker.load.pending_prompt_tokens > 0 or worker.placed_prompt_tokens > 0


class SplitwisePolicy(JSQPolicy):
    """JSQ (a mixed-only cluster is placed the same way), with the mixed pool and re-purposing."""

    name = "splitwise"

    def __init__(self) -> None:
        self._last_repurpose_at = -math.inf

    def _split(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str]) -> Decision:
        thresholds, affinity = state.thresholds, state.affinity(request)
        prompt = self._prompt_worker(state, exclude, affinity, cap=thresholds.mixed_prompt_tokens)
        if prompt is None or prompt_queue_for(prompt, affinity) > thresholds.mixed_prompt_tokens:
            overflow = self._overflow_prompt(state, request, exclude, affinity)
            if overflow is not None or prompt is None:
                return overflow or (None, [])
        token = least_token_queue(state.members(Role.TOKEN), thresholds, request, exclude)
        if token is None or token.token_queue() > thresholds.mixed_decode_tokens:
            overflow = self._overflow_token(state, request, exclude, prompt, affinity)
            if overflow is not None or token is None:
                return overflow or (None, [])
        elif affinity is not None:
            token = prefer_affine_token(state, token, affinity, request, exclude, cap=thresholds.mixed_decode_tokens)
        return Placement(prompt.worker_id, token.worker_id), []

    def choose_prompt_only(self, state: ClusterState, request: PlacementRequest, now: float,
                           exclude: frozenset[str]) -> Decision:
        """The prompt side of `_split`: the prompt worker, or past `mixed_prompt_tokens` (or with no
        candidate) the mixed pool's overflow; with no overflow target, the prompt worker still, or
        with none (its pool empty or full) the mixed worker with the least prompt queue."""
        if mixed_only(state):
            return self.choose(state, request, now, exclude)
        thresholds, affinity = state.thresholds, state.affinity(request)
        prompt = self._prompt_worker(state, exclude, affinity, cap=thresholds.mixed_prompt_tokens)
        if prompt is None or prompt_queue_for(prompt, affinity) > thresholds.mixed_prompt_tokens:
            overflow = self._overflow_prompt(state, request, exclude, affinity)
            if overflow is not None:
                return overflow
        if prompt is None:
            prompt = least_prompt_queue(state.members(Role.MIXED), thresholds, exclude)
        return run_whole_on(prompt)

    def _overflow_prompt(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str],
                         affinity: Affinity | None) -> Decision | None:
        """The whole request on a mixed worker (moving a token worker in if needed), or None."""
        mixed = least_loaded_affine(state, Role.MIXED, request, exclude, affinity,
                                    prompt_cap=state.thresholds.mixed_prompt_tokens)
        if mixed is not None:
            return run_whole_on(mixed)
        # Even a pool's last worker may move: in the mixed pool it still does its home pool's work,
        # and an empty pool's work overflows to the mixed pool.
        guest = least_loaded_affine(state, Role.TOKEN, request, exclude, affinity)
        if guest is None:
            return None
        move = PoolMove(guest.worker_id, Role.MIXED, "prompt queues over mixed_prompt_tokens")
        return Placement(guest.worker_id, guest.worker_id), [move]

    def _overflow_token(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str],
                        prompt: WorkerState, affinity: Affinity | None) -> Decision | None:
        """Decode on a mixed worker (moving a prompt worker in if needed), or None."""
        mixed = least_loaded_affine(state, Role.MIXED, request, exclude, affinity, decode_only=True,
                                    token_cap=state.thresholds.mixed_decode_tokens)
        if mixed is not None:
            return Placement(prompt.worker_id, mixed.worker_id), []
        guest = least_loaded_affine(state, Role.PROMPT, request, exclude, affinity, decode_only=True)
        if guest is None:
            return None
        move = PoolMove(guest.worker_id, Role.MIXED, "token queues over mixed_decode_tokens")
        return Placement(prompt.worker_id, guest.worker_id), [move]

    def rebalance(self, state: ClusterState, now: float, reporter: WorkerState) -> list[PoolMove]:
        """Only the reporter can have changed: a guest's load changes only with its own report, and
        what is placed on it only grows between them. So this is O(1) per report."""
        if reporter.pool is not Role.MIXED or reporter.home is Role.MIXED:
            return []
        if not has_guest_work(reporter):
            drained = f"drained its {OPPOSITE_POOL[reporter.home].value} work"
            return [PoolMove(reporter.worker_id, reporter.home, drained)]
        repurpose = self._repurpose(state, reporter, now)
        return [] if repurpose is None else [repurpose]

    def _repurpose(self, state: ClusterState, guest: WorkerState, now: float) -> PoolMove | None:
        """A guest mixed for `repurpose_after_s` changes home, at most one per period cluster-wide,
        never the last worker of its home (the O(workers) count runs only then)."""
        period = state.thresholds.repurpose_after_s
        stayed = now - guest.mixed_since if guest.mixed_since is not None else 0.0
        if stayed < period or now - self._last_repurpose_at < period:
            return None
        if sum(1 for w in state.workers.values() if w.home is guest.home) < 2:
            return None
        self._last_repurpose_at = now
        reason = f"mixed for {stayed:.0f}s: re-purposed from {guest.home.value}"
        return PoolMove(guest.worker_id, OPPOSITE_POOL[guest.home], reason, repurposed=True)
