"""Placement policies by name (the `placement_policy` of a cluster config)."""
from splitserve.placement.base import PlacementPolicy
from splitserve.placement.jsq import JSQPolicy
from splitserve.placement.round_robin import RoundRobinPolicy
from splitserve.placement.splitwise import SplitwisePolicy

PLACEMENT_POLICIES: dict[str, type[PlacementPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, JSQPolicy, SplitwisePolicy)
}


def make_placement_policy(name: str) -> PlacementPolicy:
    if name not in PLACEMENT_POLICIES:
        raise ValueError(f"placement policy must be one of {', '.join(PLACEMENT_POLICIES)}, got {name!r}")
    return PLACEMENT_POLICIES[name]()
