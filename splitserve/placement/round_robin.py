"""Round-robin placement: independent cycles over the prompt and token pools, blind to load
(beyond eligibility) and to prefix caches. The baseline Splitwise compares JSQ against."""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from splitserve.placement.base import (
    Decision,
    PlacementPolicy,
    can_decode,
    can_prompt,
    can_run_whole,
    mixed_only,
    run_whole_on,
)
from splitserve.placement.state import Placement, PlacementRequest, Role, WorkerState

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState


def _worker_id(worker: WorkerState) -> str:
    return worker.worker_id


class RoundRobinPolicy(PlacementPolicy):
    """Each pool's cycle resumes after the id it chose last, so it survives workers joining,
    leaving and moving. Cursors advance only when the whole placement succeeds. Mixed workers are
    used (whole requests, in turn) only in a mixed-only cluster."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last_chosen: dict[Role, str] = {}

    def choose(self, state: ClusterState, request: PlacementRequest, now: float,
               exclude: frozenset[str]) -> Decision:
        thresholds = state.thresholds
        if mixed_only(state):
            worker = self._next(state.members(Role.MIXED), Role.MIXED,
                                lambda w: can_run_whole(w, thresholds, request, exclude))
            if worker is None:
                return None, []
            self._last_chosen[Role.MIXED] = worker.worker_id
            return Placement(worker.worker_id, worker.worker_id), []
        prompt = self._next(state.members(Role.PROMPT), Role.PROMPT, lambda w: can_prompt(w, thresholds, exclude))
        token = self._next(state.members(Role.TOKEN), Role.TOKEN,
                           lambda w: can_decode(w, thresholds, request, exclude))
        if prompt is None or token is None:
            return None, []
        self._last_chosen[Role.PROMPT] = prompt.worker_id
        self._last_chosen[Role.TOKEN] = token.worker_id
        return Placement(prompt.worker_id, token.worker_id), []

    def choose_prompt_only(self, state: ClusterState, request: PlacementRequest, now: float,
                           exclude: frozenset[str]) -> Decision:
        """Whole on the prompt pool's next eligible worker (in a mixed-only cluster, as `choose`)."""
        if mixed_only(state):
            return self.choose(state, request, now, exclude)
        thresholds = state.thresholds
        prompt = self._next(state.members(Role.PROMPT), Role.PROMPT, lambda w: can_prompt(w, thresholds, exclude))
        if prompt is not None:
            self._last_chosen[Role.PROMPT] = prompt.worker_id
        return run_whole_on(prompt)

    def _next(self, workers: Sequence[WorkerState], pool: Role,
              eligible: Callable[[WorkerState], bool]) -> WorkerState | None:
        """The first eligible worker after the last one chosen from `pool`, wrapping around."""
        start = bisect_right(workers, self._last_chosen.get(pool, ""), key=_worker_id)
        count = len(workers)
        for offset in range(count):
            worker = workers[(start + offset) % count]
            if eligible(worker):
                return worker
        return None
