"""Background tasks that outlive the request that started them."""
from __future__ import annotations

import asyncio
import contextvars


def background(coro) -> asyncio.Task:
    """A task outside the current request's context, so Serve's cancellation of that request
    (a client gone) does not reach the work it started (worker start-up, metric flushes)."""
    return asyncio.create_task(coro, context=contextvars.Context())
