"""Hardware classes: each worker's relative prefill and decode speed, so the CLS can compare queues
across classes (a queue of N tokens on a slower worker counts as N / speed). A class's speeds are
one device's; a worker of several ranks (tensor parallelism) is faster by `tensor_parallel_speedup`."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    prompt_speed: float  # relative prefill throughput, one h100 = 1.0
    token_speed: float  # relative decode throughput, one h100 = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty hardware class name")
        for field_name in ("prompt_speed", "token_speed"):
            speed = getattr(self, field_name)
            if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
                raise ValueError(f"{field_name} of hardware {self.name!r} must be a finite number > 0, got {speed!r}")

    def with_tensor_parallel(self, tensor_parallel: int) -> HardwareProfile:
        """The speeds of a worker of `tensor_parallel` ranks of this class (same name); 1: this profile."""
        if tensor_parallel == 1:
            return self
        prompt, token = tensor_parallel_speedup(tensor_parallel)
        return HardwareProfile(self.name, self.prompt_speed * prompt, self.token_speed * token)


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


# (prompt, token) speed gained by doubling a worker's ranks: TP 1 -> 2, 2 -> 4, 4 -> 8. Measured as
# time(TP n) / time(TP 2n) in Splitwise's profiles (splitserve/data/profiles/perf_model.csv):
# llama2-70b on h100-80gb and a100-80gb, the median over the 36 (hardware, prompt_size, batch_size,
# token_size) points profiled at TP 2, 4 and 8 (outlier rows left out, as the simulator does).
# 2 -> 4: prefill 1.41, decode 1.28; 4 -> 8: prefill 1.35 (h100 alone 1.12, a100 1.38), decode 0.98
# (8 ranks decode no faster than 4: per-layer all-reduces dominate a small batch). TP 1 -> 2 is not
# profiled (70B needs 2 GPUs): it is taken as 2 -> 4. Past TP 8 nothing is profiled: no more gain.
TP_DOUBLING_GAINS = ((1.41, 1.28), (1.41, 1.28), (1.35, 0.98))


def tensor_parallel_speedup(tensor_parallel: int) -> tuple[float, float]:
    """(prompt, token) speed of a worker of `tensor_parallel` ranks over one rank of the same class:
    the product of the gains of the doublings up to it, a fraction of a doubling's gain (geometric)
    between powers of two; TP 1: (1.0, 1.0)."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {tensor_parallel!r}")
    doublings = math.log2(tensor_parallel)
    prompt = token = 1.0
    for index, (prompt_gain, token_gain) in enumerate(TP_DOUBLING_GAINS):
        share = min(max(doublings - index, 0.0), 1.0)
        prompt, token = prompt * prompt_gain ** share, token * token_gain ** share
    return prompt, token


def hardware_profile(name: str, custom: Mapping[str, HardwareProfile] | None = None) -> HardwareProfile:
    """The profile of a hardware class by name; `custom` classes (from a cluster config) win."""
    known = {**HARDWARE_CLASSES, **(custom or {})}
    if name not in known:
        raise ValueError(f"hardware must be one of {', '.join(sorted(known))}, got {name!r}")
    return known[name]
