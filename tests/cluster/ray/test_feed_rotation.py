"""A token feed that hands over to its next call, through Ray's own streaming calls: an actor with a
worker's `FeedOutbox` streams to an ingress's `DeltaFeeds` that opens a new call every 3 batches;
every delta reaches its request in order, the worker sees several calls, and none of them aborts
a request."""
from __future__ import annotations

import asyncio

from splitserve.cluster.delta_feeds import DeltaFeeds, FeedBroken


def outbox_actor():
    import ray

    from splitserve.cluster.feed_outbox import FeedOutbox
    from splitserve.cluster.worker_loop import TokenDelta

    @ray.remote(num_cpus=0)
    class Outbox:
        """A worker's feed end (`Worker.feed`) without an engine: the test says what its requests make."""

        def __init__(self):
            self.outbox, self.calls, self.aborted = FeedOutbox(self._abort), 0, []
            self.sinks = {}

        async def _abort(self, request_id):
            self.aborted.append(request_id)

        async def open(self, subscriber, request_id):
            self.sinks[request_id] = self.outbox.sink(subscriber, request_id)

        async def make(self, request_id, token, finish_reason=None):
            self.sinks[request_id](TokenDelta((token,), finish_reason))
            await asyncio.sleep(0.002)  # a step apart: one batch each

        async def feed(self, subscriber):
            self.calls += 1
            async for batch in self.outbox.stream(subscriber):
                yield batch

        async def seen(self):
            return self.calls, self.aborted
    return Outbox.remote()


def test_a_feed_rotates_its_ray_call_and_loses_nothing(head_node):
    async def scenario(worker):
        feeds = DeltaFeeds(rotate_every=3)
        queues = {}
        for rid in "ab":
            queues[rid] = feeds.open("w", worker, rid)
            await worker.open.remote(feeds.subscriber, rid)
        for token in range(40):
            await worker.make.remote("ab"[token % 2], token, "stop" if token >= 38 else None)
        got = {rid: [] for rid in queues}
        for rid, queue in queues.items():
            while not got[rid] or not (isinstance(got[rid][-1], FeedBroken) or got[rid][-1].final):
                got[rid].append(await asyncio.wait_for(queue.get(), 30))
        return got, await worker.seen.remote()

    got, (calls, aborted) = asyncio.run(scenario(outbox_actor()))
    assert [d.token_ids for d in got["a"]] == [(t,) for t in range(0, 40, 2)]
    assert [d.token_ids for d in got["b"]] == [(t,) for t in range(1, 40, 2)]
    assert calls >= 4 and aborted == []
