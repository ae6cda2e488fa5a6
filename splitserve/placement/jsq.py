"""Join the shortest queue (Splitwise IV-A routing): the prompt worker with the shortest prompt
queue and the token worker with the shortest token queue, queues weighted by hardware speed."""
from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.placement.base import (
    Decision,
    PlacementPolicy,
    least_loaded_whole,
    least_prompt_queue,
    least_token_queue,
    mixed_only,
    run_whole_on,
)
from splitserve.placement.state import Placement, PlacementRequest, Role

if TYPE_CHECKING:
    from splitserve.placement.cluster_state import ClusterState


class JSQPolicy(PlacementPolicy):
    """Pools stay fixed. A mixed-only cluster places each request whole on the worker with the
    least combined load (`base.combined_load`); otherwise mixed workers are not used."""

    name = "jsq"

    def choose(self, state: ClusterState, request: PlacementRequest, now: float,
               exclude: frozenset[str]) -> Decision:
        if mixed_only(state):
            return run_whole_on(least_loaded_whole(state.members(Role.MIXED), state.thresholds, request, exclude))
        return self._split(state, request, exclude)

    def _split(self, state: ClusterState, request: PlacementRequest, exclude: frozenset[str]) -> Decision:
        """Placement in a cluster with prompt and token pools."""
        thresholds = state.thresholds
        prompt = least_prompt_queue(state.members(Role.PROMPT), thresholds, exclude)
        token = least_token_queue(state.members(Role.TOKEN), thresholds, request, exclude)
        if prompt is None or token is None:
            return None, []
        return Placement(prompt.worker_id, token.worker_id), []
