"""Scheduling policies behind one interface, chosen by name."""
import time
from collections.abc import Callable

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies.accelgen import AccelGenPolicy, AccelGenPromptPolicy
from splitserve.engine.policies.base import Policy
from splitserve.engine.policies.mixed import MixedPolicy
from splitserve.engine.policies.orca import OrcaPolicy
from splitserve.engine.policies.plan import (
    Plan,
    ScheduledSeq,
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


def make_policy(name: str, blocks: BlockManager, limits: SchedulerLimits,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy `name`; `clock` is the time requests' arrival_time is on (SLO-aware policies read it)."""
    if name not in POLICY_CLASSES:
        raise ValueError(f"policy must be one of {', '.join(POLICY_CLASSES)}, got {name!r}")
    return POLICY_CLASSES[name](blocks, limits, clock)


__all__ = ["Plan", "Policy", "ScheduledSeq", "SchedulerLimits", "SLOOptions", "make_policy", "POLICY_CLASSES"]
