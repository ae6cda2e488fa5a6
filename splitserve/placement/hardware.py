"""Hardware classes: each worker's relative prefill and decode speed, so the CLS can compare queues
across classes (a queue of N tokens on a slower worker counts as N / speed)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    prompt_speed: float  # relative prefill throughput, h100 = 1.0
    token_speed: float  # relative decode throughput, h100 = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty hardware class name")
        for field_name in ("prompt_speed", "token_speed"):
            speed = getattr(self, field_name)
            if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
                raise ValueError(f"{field_name} of hardware {self.name!r} must be a finite number > 0, got {speed!r}")


# a100 and h100-cap: h100 time / class time in splitserve/data/profiles/perf_model.csv (Splitwise's profiles),
# llama2-70b, prompt_size 1024, batch_size 1, mean prompt_time and token_time over the runs there.
# The power cap slows prefill (compute-bound) but not decode (memory-bound), as in Splitwise Fig. 9.
# cpu: the CPU test/demo worker; one class only, so its speeds are the reference.
HARDWARE_CLASSES: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in (
        HardwareProfile("h100", 1.0, 1.0),
        HardwareProfile("a100", 0.45, 0.67),
        HardwareProfile("h100-cap", 0.77, 1.0),
        HardwareProfile("cpu", 1.0, 1.0),
    )
}


def hardware_profile(name: str, custom: Mapping[str, HardwareProfile] | None = None) -> HardwareProfile:
    """The profile of a hardware class by name; `custom` classes (from a cluster config) win."""
    known = {**HARDWARE_CLASSES, **(custom or {})}
    if name not in known:
        raise ValueError(f"hardware must be one of {', '.join(sorted(known))}, got {name!r}")
    return known[name]
