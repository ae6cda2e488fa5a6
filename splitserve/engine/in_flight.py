"""An iteration queued on the device whose sampled ids the host has not read yet.

With async scheduling the engine queues iteration N+1 as soon as the scheduler knows how N's
tokens end its sequences, then builds N's outputs while the device runs N+1. At most one
iteration is in flight: N+1 is scheduled from N's tokens, so N's are read first.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from splitserve.engine.model_runner import Forward
from splitserve.engine.outputs import StepStats
from splitserve.engine.policies import Plan
from splitserve.engine.sampler import Drawn
from splitserve.engine.sequence import Sequence


@dataclass
class InFlight:
    plan: Plan
    work: StepStats  # what the plan computes, taken before it ran
    start: float     # when it was scheduled (time.monotonic)
    forward: Forward
    drawn: Drawn
    done: torch.cuda.Event | None = None  # recorded after its last op (CUDA only)

    @classmethod
    def queued(cls, plan: Plan, work: StepStats, start: float, forward: Forward, drawn: Drawn) -> InFlight:
        done = None
        if forward.logits.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(forward.logits.device))  # its device's, whichever is current
        return cls(plan, work, start, forward, drawn, done)

    def runs(self, seq: Sequence) -> bool:
        return any(item.seq is seq for item in self.plan.scheduled)

    def wait(self) -> None:
        """Until the device has run it: its KV writes land in its sequences' blocks until then."""
        if self.done is not None:
            self.done.synchronize()


def drain(device: torch.device) -> None:
    """Until the device has run what is queued on its current stream: an iteration that failed
    part-queued may still write its sequences' blocks. A device that failed runs nothing more."""
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):  # (torch.AcceleratorError is one)
            torch.cuda.current_stream(device).synchronize()
