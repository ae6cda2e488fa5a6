"""Fault injection for failure drills and tests: make an engine's next steps raise or stall, as a
CUDA OOM, a kernel bug or a hung collective would. Reachable on a cluster worker only when its
config enables fault injection (`ClusterConfig.fault_injection`)."""
from __future__ import annotations

import time

from splitserve.engine.llm_engine import LLMEngine


class InjectedFault(RuntimeError):
    """What an injected step failure raises."""


def fail_next_steps(engine: LLMEngine, times: int = 1, leak_block: bool = False) -> None:
    """The next `times` steps raise inside the model run. `leak_block` also takes a free KV block
    out of the free list with no owner, so the engine's integrity check fails afterwards (a
    failure that leaves the state unsound)."""
    execute, left = engine.runner.execute, [times]

    def failing(*args, **kwargs):
        if left[0] <= 0:
            return execute(*args, **kwargs)
        left[0] -= 1
        if leak_block:
            engine.block_manager._pool.take_fresh(1)  # off the free lists, in no block table
        raise InjectedFault("injected step failure (as a CUDA out-of-memory error would raise)")

    engine.runner.execute = failing


def stall_next_step(engine: LLMEngine, seconds: float) -> None:
    """The next step sleeps `seconds` before it runs (a hung kernel or collective)."""
    execute, armed = engine.runner.execute, [True]

    def stalling(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            time.sleep(seconds)
        return execute(*args, **kwargs)

    engine.runner.execute = stalling
