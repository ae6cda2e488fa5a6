"""An embeddings request's runs, one per input (`SamplingParams.embed`: prompt-only, so each runs
whole on a prompt worker and no KV moves), until each has its embedding."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.cluster.dispatch import RequestFailed, Run
from splitserve.cluster.metrics import RequestObservation, kind_of


async def embeddings_of(runs: list[Run], started: float,
                        on_done: Callable[[RequestObservation], None]) -> list[tuple[float, ...]]:
    """Each run's embedding, in order; RequestFailed when one fails (after its failovers). Every
    run still going when this ends (a failure, the client gone) is stopped."""
    tasks = [asyncio.ensure_future(_embedding(run, started, on_done)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for run in runs:
            if run.finish_reason is None:
                await run.abort()


async def _embedding(run: Run, started: float, on_done: Callable[[RequestObservation], None]) -> tuple[float, ...]:
    try:
        async for _ in run.deltas():
            pass
        if run.embedding is None:
            raise RequestFailed(f"request {run.request_id} finished ({run.finish_reason}) without its embedding")
    except RequestFailed:
        on_done(_observation(run, "failed", started))
        raise
    on_done(_observation(run, "completed", started))
    return run.embedding


def _observation(run: Run, outcome: str, started: float) -> RequestObservation:
    """An embedding's: its prompt, no token returned, the time to the embedding as its end to end."""
    return RequestObservation(outcome, len(run.prompt), 0, run.cached_tokens or 0, e2e=time.monotonic() - started,
                              restarts=run.failures, refused_placements=run.refusals, lora=run.params.lora,
                              kind=kind_of(run.params))
