"""The cluster-level scheduler's placement policies (Splitwise IV-A), pure Python so the simulator
runs the same code as the Ray controller.

    state = ClusterState("splitwise")
    state.add_worker("w0", Role.PROMPT, hardware_profile("h100"))
    state.add_worker("w1", Role.TOKEN, hardware_profile("a100"))
    placement, moves = state.place(PlacementRequest("r1", num_prompt_tokens=512, max_tokens=128), now)
    moves = state.report("w0", WorkerLoad(pending_prompt_tokens=0, ...), now, PrefixDelta(16, 4096, added=...))

The caller switches the engine role of every worker named in `moves` to `move.to_pool.value`. With
prefix-aware placement, requests name their prompt's block hashes (`prefix_hashes`) and reports
carry the workers' prefix-cache deltas (both optional).
"""
from splitserve.placement.base import PlacementPolicy
from splitserve.placement.cluster_state import ClusterState
from splitserve.placement.jsq import JSQPolicy
from splitserve.placement.registry import PLACEMENT_POLICIES, make_placement_policy
from splitserve.placement.round_robin import RoundRobinPolicy
from splitserve.placement.splitwise import SplitwisePolicy
from splitserve.placement.state import (Placement, PlacementRequest, PlacementThresholds, PoolMove, PrefixDelta,
                                        PrefixOptions, Role, WorkerLoad, WorkerState)

__all__ = [
    "PLACEMENT_POLICIES", "ClusterState", "JSQPolicy", "Placement", "PlacementPolicy", "PlacementRequest",
    "PlacementThresholds", "PoolMove", "PrefixDelta", "PrefixOptions", "Role", "RoundRobinPolicy", "SplitwisePolicy",
    "WorkerLoad", "WorkerState",
    "make_placement_policy",
]
