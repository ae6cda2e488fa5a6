"""The token deltas of a subscriber's requests (an ingress replica's, a batch run's), one feed per
worker: a single streaming call to the worker's `feed` carries every request's deltas, and each
delta goes to the queue of the request it belongs to. A step that makes tokens for many requests
is one message, not one per request. Every `rotate_every` batches the feed opens its next call and
reads the current one to its end (the worker ends it where the next begins, `FeedOutbox`): Ray
holds native memory on both ends for each item of a streaming call until the call ends.

Invariants: a request's queue is registered before the call that opens it on the worker, so no
delta of it is missed; a delta for a request not registered (aborted, or a failed attempt's) is
dropped; when a feed breaks (its worker died, or the call failed), every request waiting on that
worker gets a `FeedBroken` and the next request opens a new feed.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass

from ray.exceptions import RayActorError, RayError, RayTaskError

log = logging.getLogger("splitserve.feeds")


def detached(method, *args):
    """`method.remote(*args)` sent outside the current Ray task's context (an empty one), so that it
    is not that task's child: Ray cancels the children of a cancelled task (Serve cancels the
    request of a client that went away), which must not take down a feed other requests share, or
    an abort sent while the request is being cancelled."""
    return contextvars.Context().run(method.remote, *args)


@dataclass(frozen=True)
class FeedBroken:
    """Put in a request's queue when its worker's feed ends: the attempt fails (`dead`: the worker is gone)."""
    reason: str
    dead: bool


ROTATE_EVERY = 1000  # batches per feed call: at 50 a second, a call every 20 s


class DeltaFeeds:
    def __init__(self, subscriber: str | None = None, rotate_every: int = ROTATE_EVERY):
        self.subscriber = subscriber or f"sub-{uuid.uuid4().hex}"
        self.rotate_every = rotate_every
        self._pumps: dict[str, asyncio.Task] = {}  # worker id -> the task reading its feed
        self._queues: dict[str, dict[str, asyncio.Queue]] = {}  # worker id -> request id -> its deltas

    def open(self, worker_id: str, handle, request_id: str) -> asyncio.Queue:
        """The queue `request_id`'s deltas from `worker_id` will come to (call before opening it there)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.setdefault(worker_id, {})[request_id] = queue
        pump = self._pumps.get(worker_id)
        if pump is None or pump.done():  # the subscriber's own task, not the opening request's (see `detached`)
            pump = asyncio.get_running_loop().create_task(self._pump(worker_id, handle), context=contextvars.Context())
            self._pumps[worker_id] = pump
        return queue

    def close(self, worker_id: str, request_id: str) -> None:
        """No more deltas wanted for `request_id` (it ended, or its attempt was dropped)."""
        self._queues.get(worker_id, {}).pop(request_id, None)

    def forget(self, worker_id: str) -> None:
        """The worker is gone: stop reading its feed, and fail every request still waiting on it."""
        pump = self._pumps.pop(worker_id, None)
        if pump is not None:
            pump.cancel()
        self._break(worker_id, FeedBroken(f"worker {worker_id} is gone", dead=True))

    async def _pump(self, worker_id: str, handle) -> None:
        try:
            call = handle.feed.remote(self.subscriber)
            while call is not None:
                call = await self._read(worker_id, handle, call)
            broken = FeedBroken(f"worker {worker_id} ended its token feed", dead=False)
        except RayActorError:
            broken = FeedBroken(f"worker {worker_id} died", dead=True)
        except Exception as error:  # a failed call (RayTaskError), or a bug here: its requests fail over
            cause = error.cause if isinstance(error, RayTaskError) else error
            log.warning("token feed from %s failed: %s", worker_id, cause, exc_info=not isinstance(error, RayError))
            broken = FeedBroken(f"worker {worker_id}'s token feed failed: {cause}", dead=False)
        self._break(worker_id, broken)

    async def _read(self, worker_id: str, handle, call):
        """Delivers `call`'s batches until it ends; returns the call that takes over from it (opened
        after `rotate_every` batches), or None if it ended of itself."""
        batches, following = 0, None
        async for ref in call:
            queues = self._queues.get(worker_id, {})
            for request_id, delta in await ref:
                queue = queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            batches += 1
            if batches == self.rotate_every:
                following = handle.feed.remote(self.subscriber)
        return following

    def _break(self, worker_id: str, broken: FeedBroken) -> None:
        for queue in self._queues.pop(worker_id, {}).values():
            queue.put_nowait(broken)
