"""Scheduling policies behind one interface, chosen by name."""
import time
from collections.abc import Callable, Iterable

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies.accelgen import AccelGenPolicy, AccelGenPromptPolicy
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.mixed import MixedPolicy
from splitserve.engine.policies.orca import OrcaPolicy
from splitserve.engine.policies.plan import (
    Plan,
    ScheduledSeq,
    SCHEDULING_POLICIES,
    SchedulerLimits,
    SLOOptions,
)
from splitserve.engine.policies.prefill_first import PrefillFirstPolicy
from splitserve.engine.policies.prompt import PromptPolicy
from splitserve.engine.policies.token import TokenPolicy

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (PromptPolicy, TokenPolicy, MixedPolicy, PrefillFirstPolicy, OrcaPolicy,
                              AccelGenPolicy, AccelGenPromptPolicy)
}


def check_scheduling(scheduling_policy: str, policies: Iterable[str]) -> None:
    """ValueError unless `scheduling_policy` is fcfs or priority, and priority only where every one of
    `policies` (the engine policies a worker may run) orders by priority."""
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}")
    by_slack = [p for p in policies if not POLICY_CLASSES[p].takes_priorities]
    if scheduling_policy == "priority" and by_slack:
        raise ValueError(f"scheduling_policy priority: the {by_slack[0]} policy orders requests by their latency "
                         "targets' slack, not by priority")


def make_policy(name: str, blocks: BlockManager, limits: SchedulerLimits,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy `name`; `clock` is the time requests' arrival_time is on (SLO-aware policies read it)."""
    if name not in POLICY_CLASSES:
        raise ValueError(f"policy must be one of {', '.join(POLICY_CLASSES)}, got {name!r}")
    return POLICY_CLASSES[name](blocks, limits, clock)


__all__ = ["Plan", "Policy", "ScheduledSeq", "SchedulerLimits", "SLOOptions", "make_policy",
           "check_scheduling", "POLICY_CLASSES", "SCHEDULING_POLICIES"]
