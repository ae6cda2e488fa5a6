"""How often an event loop gets a turn while a coroutine runs on it (a stall shows as few ticks)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def loop_ticks_during(work: Awaitable) -> int:
    """Turns of a 1 ms ticker on this loop while `work` is awaited."""
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    before = ticks
    try:
        await work
    finally:
        ticker.cancel()
    return ticks - before
