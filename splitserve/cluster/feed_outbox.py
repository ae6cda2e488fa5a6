"""A worker's end of its token feeds: per subscriber (an ingress replica, the batch manager), one
queue the engine thread fills with (request id, delta) in the order made, read by that subscriber's
streaming `feed` call in batches of what has come.

A subscriber ends a feed call and opens the next now and then (Ray holds native memory for each
item of a long-lived streaming call, on both ends, until the call ends). Invariants: one call
reads a subscriber's queue at a time; a new call puts a handover mark in the queue and reads only
after the call before it has read up to that mark and ended, so no delta is lost or reordered
across calls; a call that ends without being handed over (its subscriber went away, or the call
failed) drops the queue and aborts the subscriber's requests still open, so none runs unread.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from splitserve.cluster.worker_loop import TokenDelta

Batch = list[tuple[str, TokenDelta]]
_HANDOVER = object()  # in a subscriber's queue: the call reading it ends here and the next one reads on


class FeedOutbox:
    def __init__(self, abort: Callable[[str], Awaitable[None]]):
        self._abort = abort  # stops a request on the engine
        self._queues: dict[str, asyncio.Queue] = {}  # subscriber -> its deltas, made by its first call or request
        self._readers: dict[str, asyncio.Future] = {}  # subscriber -> its newest call, done when that stops reading
        self._subscriber_of: dict[str, str] = {}  # open request -> the subscriber its deltas go to

    def sink(self, subscriber: str, request_id: str) -> Callable[[TokenDelta], None]:
        """Opens `request_id` for `subscriber`: a sink the engine thread may call with its deltas."""
        queue, loop = self._queue(subscriber), asyncio.get_running_loop()
        self._subscriber_of[request_id] = subscriber
        return lambda delta: loop.call_soon_threadsafe(queue.put_nowait, (request_id, delta))

    def drop(self, request_id: str) -> None:
        """`request_id` is no longer open (it was aborted, or never opened on the engine)."""
        self._subscriber_of.pop(request_id, None)

    async def stream(self, subscriber: str) -> AsyncIterator[Batch]:
        """`subscriber`'s deltas in batches of what has come, until the next call takes over or the
        caller goes away."""
        queue = self._queue(subscriber)
        before, mine = self._readers.get(subscriber), asyncio.get_running_loop().create_future()
        self._readers[subscriber] = mine
        try:
            if before is not None and not before.done():
                queue.put_nowait(_HANDOVER)
                await asyncio.wait([before])  # (not `await before`: cancelling this call must not cancel it)
            while True:
                batch, handed_over = self._take(await queue.get(), queue)
                if batch:
                    yield batch
                if handed_over:
                    return
        finally:
            mine.set_result(None)
            if self._readers.get(subscriber) is mine:  # no call takes over: the subscriber is gone
                del self._readers[subscriber]
                if self._queues.get(subscriber) is queue:
                    del self._queues[subscriber]
                for request_id in [rid for rid, owner in self._subscriber_of.items() if owner == subscriber]:
                    del self._subscriber_of[request_id]
                    await self._abort(request_id)

    def _take(self, item, queue: asyncio.Queue) -> tuple[Batch, bool]:
        """`item` and what has come after it, up to a handover mark (the rest is the next call's);
        and whether the mark was reached. A request's final delta closes it."""
        batch: Batch = []
        while item is not _HANDOVER:
            batch.append(item)
            if item[1].final:
                self._subscriber_of.pop(item[0], None)
            if queue.empty():
                return batch, False
            item = queue.get_nowait()
        return batch, True

    def _queue(self, subscriber: str) -> asyncio.Queue:
        return self._queues.setdefault(subscriber, asyncio.Queue())
