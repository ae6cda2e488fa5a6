"""One token feed per worker carries every request's deltas (no Ray: a stand-in worker whose feed
yields what the test puts in it): each delta reaches its request's queue, and a feed that breaks
or a worker that is forgotten fails every request waiting on it, so none hangs."""
from __future__ import annotations

import asyncio
import contextvars

from ray.exceptions import RayActorError, RayTaskError

from splitserve.cluster.delta_feeds import DeltaFeeds, FeedBroken, detached
from splitserve.cluster.feed_outbox import FeedOutbox
from splitserve.cluster.worker_loop import TokenDelta


class _Worker:
    """`handle.feed.remote(subscriber)`: a stream of the batches (or the exception) put in `sent`."""

    def __init__(self):
        self.sent: asyncio.Queue = asyncio.Queue()
        self.subscribers: list[str] = []
        self.feed = self

    def remote(self, subscriber: str):
        self.subscribers.append(subscriber)

        async def stream():
            while True:
                item = await self.sent.get()
                if isinstance(item, BaseException):
                    raise item
                ref = asyncio.get_running_loop().create_future()
                ref.set_result(item)
                yield ref
        return stream()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_each_delta_reaches_its_request_through_one_feed_per_worker():
    async def scenario():
        feeds, worker = DeltaFeeds("ingress-1"), _Worker()
        a, b = feeds.open("w", worker, "a"), feeds.open("w", worker, "b")
        worker.sent.put_nowait([("a", TokenDelta((1,))), ("b", TokenDelta((2,))), ("gone", TokenDelta((3,))),
                                ("a", TokenDelta((4,), "stop"))])
        await settle()
        feeds.close("w", "a")
        worker.sent.put_nowait([("a", TokenDelta((5,))), ("b", TokenDelta((6,), "length"))])  # a's is late: dropped
        await settle()
        return worker.subscribers, drain(a), drain(b)

    subscribers, a, b = asyncio.run(scenario())
    assert subscribers == ["ingress-1"]  # one call carries both requests
    assert [(d.token_ids, d.finish_reason) for d in a] == [((1,), None), ((4,), "stop")]
    assert [(d.token_ids, d.finish_reason) for d in b] == [((2,), None), ((6,), "length")]


class _OutboxWorker:
    """`handle.feed.remote(subscriber)` on a worker's real `FeedOutbox`, run eagerly as Ray runs a
    streaming call: the call reads the outbox from when it is sent, whether or not its caller reads yet."""

    def __init__(self):
        self.outbox = FeedOutbox(self._abort)
        self.aborted: list[str] = []
        self.calls = 0
        self.feed = self

    async def _abort(self, request_id):
        self.aborted.append(request_id)

    def remote(self, subscriber: str):
        self.calls += 1
        refs: asyncio.Queue = asyncio.Queue()

        async def run():
            async for batch in self.outbox.stream(subscriber):
                ref = asyncio.get_running_loop().create_future()
                ref.set_result(batch)
                refs.put_nowait(ref)
            refs.put_nowait(None)
        asyncio.get_running_loop().create_task(run())

        async def stream():
            while (ref := await refs.get()) is not None:
                yield ref
        return stream()


def test_a_feed_hands_over_to_its_next_call_every_few_batches_and_loses_nothing():
    async def scenario():
        feeds, worker = DeltaFeeds(rotate_every=2), _OutboxWorker()
        queues = {rid: feeds.open("w", worker, rid) for rid in "ab"}
        sinks = {rid: worker.outbox.sink(feeds.subscriber, rid) for rid in "ab"}
        for token in range(20):
            sinks["ab"[token % 2]](TokenDelta((token,)))
            if token % 2:  # batches of two deltas
                await settle()
        await settle()
        return {rid: drain(queue) for rid, queue in queues.items()}, worker.calls, list(worker.aborted)

    got, calls, aborted = asyncio.run(scenario())
    assert [d.token_ids for d in got["a"]] == [(t,) for t in range(0, 20, 2)]
    assert [d.token_ids for d in got["b"]] == [(t,) for t in range(1, 20, 2)]
    assert calls >= 4 and aborted == []


def test_a_dead_worker_fails_every_waiting_request_and_the_next_request_opens_a_new_feed():
    async def scenario():
        feeds, worker = DeltaFeeds(), _Worker()
        waiting = [feeds.open("w", worker, rid) for rid in ("a", "b")]
        worker.sent.put_nowait(RayActorError())
        await settle()
        later = feeds.open("w", worker, "c")
        worker.sent.put_nowait([("c", TokenDelta((7,), "stop"))])
        await settle()
        return [drain(q) for q in waiting], drain(later), len(worker.subscribers)

    waiting, later, calls = asyncio.run(scenario())
    assert all(len(items) == 1 and isinstance(items[0], FeedBroken) and items[0].dead for items in waiting)
    assert [d.token_ids for d in later] == [(7,)] and calls == 2


def test_a_failed_feed_call_fails_its_requests_over_without_calling_the_worker_dead():
    async def scenario():
        feeds, worker = DeltaFeeds(), _Worker()
        queue = feeds.open("w", worker, "a")
        worker.sent.put_nowait(RayTaskError("feed", "traceback", ValueError("boom")))
        await settle()
        return drain(queue)

    [broken] = asyncio.run(scenario())
    assert isinstance(broken, FeedBroken) and not broken.dead and "boom" in broken.reason


def test_forgetting_a_worker_fails_the_requests_on_it_at_once():
    """Its death was seen elsewhere first (a call to it failed): no request waits for a feed that
    will say nothing more."""
    async def scenario():
        feeds, worker, other = DeltaFeeds(), _Worker(), _Worker()
        gone, alive = feeds.open("w", worker, "a"), feeds.open("v", other, "b")
        await settle()
        feeds.forget("w")
        await settle()
        return drain(gone), drain(alive)

    gone, alive = asyncio.run(scenario())
    assert len(gone) == 1 and gone[0].dead and alive == []


REQUEST = contextvars.ContextVar("request", default=None)  # stands for Ray's current-task context variable


def test_the_feed_call_is_not_a_child_of_the_request_that_opened_it():
    """Ray cancels a cancelled task's child calls, and Serve cancels the request of a client that
    went away: the feed other requests share must not be that request's child."""
    class Recording(_Worker):
        def remote(self, subscriber):
            self.parent = REQUEST.get()
            return super().remote(subscriber)

    async def request(feeds, worker):
        REQUEST.set("the first request")
        feeds.open("w", worker, "a")
        await settle()

    worker = Recording()
    asyncio.run(request(DeltaFeeds(), worker))
    assert worker.parent is None


def test_a_detached_call_is_sent_outside_the_request():
    class Method:
        def remote(self, *args):
            return REQUEST.get(), args

    REQUEST.set("a request being cancelled")
    assert detached(Method(), "abort", 1) == (None, ("abort", 1))
    assert REQUEST.get() == "a request being cancelled"  # the caller's context is left as it was
