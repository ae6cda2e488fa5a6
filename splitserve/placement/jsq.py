"""Join the shortest queue (Splitwise IV-A routing): the prompt worker with the shortest prompt
queue and the token worker with the shortest token queue, queues weighted by hardware speed, less
the work a worker's cached prefix of the request saves, plus what the request's LoRA adapter costs
where no slot holds it (affinity.py; `prefix.aware`, `adapters.aware`)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from splitserve.placement.base import (
    Decision,
    PlacementPolicy,
    least_prompt_queue,
    least_token_queue,
    mixed_only,
    run_whole_on,
)
from splitserve.placement.affinity import Affinity, least_loaded_affine, prefer_affine_prompt, prefer_affine_token
from splitserve.placement.state import Placement, PlacementRequest, Role, WorkerState

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState


class JSQPolicy(PlacementPolicy):
    """Pools stay fixed. A mixed-only cluster places each request whole on the worker with the
    least combined load (`base.combined_load`); otherwise mixed workers are not used."""

    name = "jsq"

    def choose(self, state: ClusterState, request: PlacementRequest, now: float,
               exclude: frozenset[str]) -> Decision:
        if mixed_only(state):
            return run_whole_on(least_loaded_affine(state, Role.MIXED, request, exclude, state.affinity(request)))
        return self._split(state, request, exclude)

    def choose_prompt_only(self, state: ClusterState, request: PlacementRequest, now: float,
                           exclude: frozenset[str]) -> Decision:
        """Whole on the prompt worker `_split` would prefill it on (in a mixed-only cluster, as `choose`)."""
        if mixed_only(state):
            return self.choose(state, request, now, exclude)
        return run_whole_on(self._prompt_worker(state, exclude, state.affinity(request)))

    @staticmethod
    def _prompt_worker(state: ClusterState, exclude: frozenset[str], affinity: Affinity | None,
                       cap: float = math.inf) -> WorkerState | None:
        """The prompt candidate with the least queue, less what its cached prefix saves (`affinity`;
        among those queued <= `cap`, where the blind choice is not)."""
        prompt = least_prompt_queue(state.members(Role.PROMPT), state.thresholds, exclude)
        if prompt is None or affinity is None:
            return prompt
        return prefer_affine_prompt(state, prompt, affinity, exclude, cap)

    def _split(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str]) -> Decision:
        """Placement in a cluster with prompt and token pools."""
        thresholds = state.thresholds
        prompt = least_prompt_queue(state.members(Role.PROMPT), thresholds, exclude)
        token = least_token_queue(state.members(Role.TOKEN), thresholds, request, exclude)
        if prompt is None or token is None:
            return None, []
        affinity = state.affinity(request)
        if affinity is not None:
            prompt = prefer_affine_prompt(state, prompt, affinity, exclude)
            token = prefer_affine_token(state, token, affinity, request, exclude)
        return Placement(prompt.worker_id, token.worker_id), []
