"""Join the shortest queue (Splitwise IV-A routing): the prompt worker with the shortest prompt
queue and the token worker with the shortest token queue, queues weighted by hardware speed, less
the work a worker's cached prefix of the request saves (saved_work.py; `prefix.aware`)."""
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
from splitserve.placement.saved_work import SavedWork, least_loaded_saving, prefer_cached_prompt, prefer_cached_token
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
            return run_whole_on(least_loaded_saving(state, Role.MIXED, request, exclude, state.saved_work(request)))
        return self._split(state, request, exclude)

    def choose_prompt_only(self, state: ClusterState, request: PlacementRequest, now: float,
                           exclude: frozenset[str]) -> Decision:
        """Whole on the prompt worker `_split` would prefill it on (in a mixed-only cluster, as `choose`)."""
        if mixed_only(state):
            return self.choose(state, request, now, exclude)
        return run_whole_on(self._prompt_worker(state, exclude, state.saved_work(request)))

    @staticmethod
    def _prompt_worker(state: ClusterState, exclude: frozenset[str], saved: SavedWork | None,
                       cap: float = math.inf) -> WorkerState | None:
        """The prompt candidate with the least queue, less what its cached prefix saves (`saved`;
        among those queued <= `cap`, where the blind choice is not)."""
        prompt = least_prompt_queue(state.members(Role.PROMPT), state.thresholds, exclude)
        return prompt if prompt is None or saved is None else prefer_cached_prompt(state, prompt, saved, exclude, cap)

    def _split(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str]) -> Decision:
        """Placement in a cluster with prompt and token pools."""
        thresholds = state.thresholds
        prompt = least_prompt_queue(state.members(Role.PROMPT), thresholds, exclude)
        token = least_token_queue(state.members(Role.TOKEN), thresholds, request, exclude)
        if prompt is None or token is None:
            return None, []
        saved = state.saved_work(request)
        if saved is not None:
            prompt = prefer_cached_prompt(state, prompt, saved, exclude)
            token = prefer_cached_token(state, token, saved, request, exclude)
        return Placement(prompt.worker_id, token.worker_id), []
