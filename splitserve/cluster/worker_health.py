"""Why a worker that failed a call or a poll should leave its pool, if it should: its engine loop's
health, read without waiting for the loop (`Worker.health`), so a worker merely busy with a long
step is told apart from a dead, unhealthy or stuck one."""
from __future__ import annotations

import asyncio

from ray.exceptions import GetTimeoutError, RayActorError

CALL_TIMEOUT_S = 10.0  # a call not answered in this long makes the controller look at the worker's health
STALE_HEARTBEAT_S = 30.0  # an engine loop that has not begun an iteration for this long, outside a step, is hung


async def diagnose(handle, stuck_step_s: float) -> str | None:
    """None if the worker's engine loop is sound and turning (or in a step of at most
    `stuck_step_s`), else what is wrong."""
    try:
        health = await asyncio.wait_for(handle.health.remote(), CALL_TIMEOUT_S)
    except (RayActorError, asyncio.TimeoutError, GetTimeoutError):
        return "dead (no answer)"
    if not health["alive"]:
        return "unhealthy: its engine loop ended"
    if not health["healthy"]:
        return f"unhealthy: {health['reason']}"
    if health["step_running_s"] > stuck_step_s:
        return f"stuck: a step has run {health['step_running_s']:.0f} s"
    if health["step_running_s"] == 0 and health["heartbeat_age_s"] > STALE_HEARTBEAT_S:
        return f"stuck: its engine loop has not turned for {health['heartbeat_age_s']:.0f} s"
    return None
