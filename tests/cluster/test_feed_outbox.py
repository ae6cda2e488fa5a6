"""A worker's end of its token feeds (no Ray, no engine: the test plays the engine thread and the
feed calls): a subscriber's deltas come in order and in batches; a call that takes over from another
gets exactly what the one before left, so nothing is lost or repeated across calls; only a call
that ends without a successor aborts the subscriber's open requests."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.feed_outbox import FeedOutbox
from splitserve.cluster.worker_loop import TokenDelta


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


class Call:
    """A feed call, read eagerly as Ray runs a streaming call: its batches as they come, and whether it ended."""

    def __init__(self, outbox: FeedOutbox, subscriber: str):
        self.batches: list = []
        self.task = asyncio.get_running_loop().create_task(self._read(outbox.stream(subscriber)))

    async def _read(self, stream):
        async for batch in stream:
            self.batches.append([(rid, delta.token_ids) for rid, delta in batch])

    @property
    def tokens(self) -> list:
        return [item for batch in self.batches for item in batch]


def outbox_and_aborts() -> tuple[FeedOutbox, list[str]]:
    aborted: list[str] = []

    async def abort(request_id: str) -> None:
        aborted.append(request_id)
    return FeedOutbox(abort), aborted


def test_deltas_come_in_order_and_in_batches_of_what_has_come():
    async def scenario():
        outbox, aborted = outbox_and_aborts()
        a, b = outbox.sink("ingress", "a"), outbox.sink("ingress", "b")
        a(TokenDelta((1,)))
        b(TokenDelta((2,)))
        await settle()  # the call opens after its first deltas: they wait for it
        call = Call(outbox, "ingress")
        await settle()
        a(TokenDelta((3,), "stop"))
        await settle()
        return call.batches, list(aborted)  # (asyncio.run then cancels the call)

    batches, aborted = asyncio.run(scenario())
    assert batches == [[("a", (1,)), ("b", (2,))], [("a", (3,))]] and aborted == []


def test_a_call_that_takes_over_gets_what_the_one_before_left_in_order():
    async def scenario():
        outbox, aborted = outbox_and_aborts()
        sinks = {rid: outbox.sink("ingress", rid) for rid in "ab"}
        calls, sent = [Call(outbox, "ingress")], []
        for token in range(30):
            rid = "ab"[token % 2]
            sinks[rid](TokenDelta((token,)))
            sent.append((rid, (token,)))
            if token % 7 == 3:  # a new call while deltas are queued and the last one is still reading
                calls.append(Call(outbox, "ingress"))
            if token % 3 == 0:
                await asyncio.sleep(0)
        await settle()
        return [call.task.done() for call in calls], [call.tokens for call in calls], sent, list(aborted)

    ended, tokens, sent, aborted = asyncio.run(scenario())
    assert ended == [True] * (len(ended) - 1) + [False] and len(ended) == 5  # each but the newest handed over
    assert [item for call in tokens for item in call] == sent
    assert aborted == []  # a call handed over aborts nothing


def test_a_call_that_ends_without_a_successor_aborts_the_open_requests_only():
    async def scenario():
        outbox, aborted = outbox_and_aborts()
        first = Call(outbox, "ingress")
        for rid in "abc":
            outbox.sink("ingress", rid)(TokenDelta((1,), "stop" if rid == "b" else None))
        outbox.sink("batch", "d")
        outbox.drop("c")  # aborted by its own request
        await settle()
        second = Call(outbox, "ingress")
        await settle()
        assert first.task.done() and aborted == []
        second.task.cancel()  # the subscriber went away
        await settle()
        return aborted

    assert asyncio.run(scenario()) == ["a"]  # b finished, c was dropped, d is another subscriber's


def test_a_successor_cancelled_while_it_waits_cleans_up_once_and_the_one_before_ends_at_its_mark():
    async def scenario():
        outbox, aborted = outbox_and_aborts()
        outbox.sink("ingress", "a")(TokenDelta((1,)))
        await settle()
        first = outbox.stream("ingress")  # read by hand: it stalls after its first batch
        batch = await first.__anext__()
        second = Call(outbox, "ingress")
        await settle()  # the second waits for the first to reach its mark
        second.task.cancel()
        await settle()
        cleaned_up = list(aborted)
        with pytest.raises(StopAsyncIteration):  # the first reads on to the mark and ends, aborting nothing more
            await first.__anext__()
        outbox.sink("ingress", "b")(TokenDelta((2,)))  # a later request: a fresh queue
        third = Call(outbox, "ingress")
        await settle()
        return batch, cleaned_up, third.batches, list(aborted)

    batch, cleaned_up, third, aborted = asyncio.run(scenario())
    assert [(rid, d.token_ids) for rid, d in batch] == [("a", (1,))] and third == [[("b", (2,))]]
    assert cleaned_up == aborted == ["a"]


def test_a_failed_call_is_no_handover():
    """A call that fails (the subscriber's read raised) cleans up like a subscriber that went away."""
    async def scenario():
        outbox, aborted = outbox_and_aborts()
        outbox.sink("ingress", "a")(TokenDelta((1,)))
        await settle()
        stream = outbox.stream("ingress")
        await stream.__anext__()
        with pytest.raises(RuntimeError):
            await stream.athrow(RuntimeError("the call failed"))
        return aborted

    assert asyncio.run(scenario()) == ["a"]
