"""What the ingress asks the CLS for a request (no Ray: a stand-in CLS and workers): the prompt's
block hashes for prefix-aware placement, which are the ones the engines' block managers cache; an
attempt whose prompt worker refuses the ticket; token workers that refuse the reservation; a
request that ends leaves no queue behind in the replica's token feeds; a dead CLS fails the
request with a 503 and marks the directory for the ingress to replace; a CLS with no worker ready
refuses a new request as unavailable, and a failover waits for it as it waits for room."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from splitserve.cluster import dispatch
from splitserve.cluster.dispatch import ClusterUnavailable, Overloaded, RequestFailed, Run, WorkerDirectory
from splitserve.cluster.worker_loop import TokenDelta
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.prefix_hash import PrefixNaming
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement import Placement
from splitserve.placement.state import REFUSED_TRIES
from splitserve.transfer.link import TransferError
from tests.engine.block_helpers import cached


class _CLS:
    """Refuses every placement, keeping the requests it was asked to place."""

    def __init__(self):
        self.requests = []
        self.place = self

    def remote(self, request, exclude, lora):
        self.requests.append(request)

        async def answer():
            return None
        return answer()


def asked(prompt: list[int], prefix_block_size: int, params: SamplingParams = SamplingParams(max_tokens=4)):
    cls = _CLS()
    run = Run("r", prompt, params, WorkerDirectory(cls), max_attempts=1, prefix=PrefixNaming(prefix_block_size))
    with pytest.raises(Overloaded):
        asyncio.run(run.admit())
    return cls.requests[0]


def test_the_request_names_the_blocks_a_block_manager_caches_for_the_prompt():
    prompt = [(i * 7 + 3) % 256 for i in range(70)]
    blocks = BlockManager(16, block_size=8)
    cached(blocks, "earlier", prompt)  # an earlier turn: every full block of the prompt cached
    request = asked(prompt, 8)
    assert request.num_prompt_tokens == 70 and len(request.prefix_hashes) == 8  # (70 - 1) // 8
    assert request.prefix_hashes == blocks.take_prefix_snapshot()[:8]


def test_no_hashes_when_prefix_aware_placement_is_off_or_the_cache_would_not_be_used():
    prompt = list(range(40))
    assert asked(prompt, 0).prefix_hashes == ()
    assert asked(prompt, 8, SamplingParams(max_tokens=4, prompt_logprobs=1)).prefix_hashes == ()


class _Call:
    """`handle.method.remote(...)`: a future of `result`, or of its raising if an exception."""

    def __init__(self, result, calls: list, name: str):
        self.result, self.calls, self.name = result, calls, name
        self.args: list[tuple] = []  # of every call

    def remote(self, *args):
        self.calls.append(self.name)
        self.args.append(args)
        answer = asyncio.get_running_loop().create_future()
        if isinstance(self.result, BaseException):
            answer.set_exception(self.result)
        else:
            answer.set_result(self.result)
        return answer


class _Worker:
    def __init__(self, calls: list, **results):
        for name in ("reserve", "prefill", "abort"):
            setattr(self, name, _Call(results.get(name), calls, name))
        self.feed = _SilentFeed()


class _SilentFeed:
    """`handle.feed.remote(subscriber)`: a token feed that sends nothing."""

    def remote(self, subscriber):
        async def nothing():
            await asyncio.Event().wait()
            yield
        return nothing()


class _PlacingCLS:
    def __init__(self, workers: dict):
        self.workers, self.place, self.worker_handle = workers, _Call(Placement("p", "t"), [], "place"), self
        self.worker_failed = _Call(None, [], "worker_failed")

    def remote(self, worker_id):
        async def answer():
            return self.workers[worker_id]
        return answer()


def test_a_prompt_worker_that_refuses_the_ticket_fails_the_attempt_over_and_frees_both_sides():
    """The token worker gave the transfer up before the prompt worker claimed it (or holds
    another layout): the prefill call raises; the attempt fails over instead of failing the request."""
    calls: list = []
    refused = RayTaskError("prefill", "traceback", TransferError("t", "it gave the transfer up first"))
    workers = {"p": _Worker(calls, prefill=refused), "t": _Worker(calls, reserve="ticket")}
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4), WorkerDirectory(_PlacingCLS(workers)), max_attempts=1)

    async def drive():
        await run.admit()
        return [delta async for delta in run.deltas()]

    with pytest.raises(RequestFailed, match="prompt worker refused the transfer: .*gave the transfer up first"):
        asyncio.run(drive())
    assert calls.count("abort") == 2  # the failed attempt is aborted on both workers


def test_the_workers_get_the_adapter_identity_the_request_was_placed_under():
    """The CLS names the identity of the request's adapter as it places it: both workers check it."""
    calls: list = []
    workers = {"p": _Worker(calls), "t": _Worker(calls, reserve="ticket")}
    cls = _PlacingCLS(workers)
    cls.place.result = Placement("p", "t", lora_identity="sql\0digest")
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4, lora="sql"), WorkerDirectory(cls), max_attempts=1)
    asyncio.run(run.admit())
    assert cls.place.args[0][2] == "sql"  # the adapter asked of the CLS by name
    assert cls.place.args[0][0].priority == 0
    sent = [args[2] for args in workers["t"].reserve.args + workers["p"].prefill.args]
    assert len(sent) == 2 and all(params.lora_identity == "sql\0digest" for params in sent)


def test_the_placement_request_carries_the_priority():
    cls = _PlacingCLS({"p": _Worker([]), "t": _Worker([], reserve="ticket")})
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4, priority=2), WorkerDirectory(cls), max_attempts=1)
    asyncio.run(run.admit())
    assert cls.place.args[0][0].priority == 2


class _ExcludingCLS(_PlacingCLS):
    """Places on the first token worker of `order` not excluded (None when none is left), and
    keeps what each placement excluded."""

    def __init__(self, workers: dict, order: list[str]):
        super().__init__(workers)
        self.order, self.excluded, self.place = order, [], self

    def remote(self, *args):
        if len(args) == 1:  # worker_handle.remote(worker_id)
            return super().remote(*args)
        request, exclude, _ = args
        self.excluded.append(set(exclude))
        left = [t for t in self.order if t not in exclude]

        async def answer():
            return Placement("p", left[0]) if left else None
        return answer()


def _full(worker: str) -> RayTaskError:
    return RayTaskError("reserve", "traceback", EngineFullError(f"{worker} has no KV room"))


def test_a_token_worker_that_refuses_the_reservation_is_left_out_of_the_next_placement():
    """The CLS placed by a stale load report: the reservation is refused, and the request is
    placed again without that worker instead of answering 429."""
    calls: list = []
    workers = {"p": _Worker(calls, prefill="first"), "t1": _Worker(calls, reserve=_full("t1")),
               "t2": _Worker(calls, reserve="ticket")}
    cls = _ExcludingCLS(workers, ["t1", "t2"])
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4), WorkerDirectory(cls), max_attempts=1)
    asyncio.run(run.admit())
    assert cls.excluded == [set(), {"t1"}] and run.placement == Placement("p", "t2")
    assert calls[:3] == ["reserve", "reserve", "prefill"] and (run.failures, run.refusals) == (0, 1)


def test_refusals_end_in_overloaded_after_a_bounded_number_of_placements():
    calls: list = []
    order = [f"t{i}" for i in range(REFUSED_TRIES + 2)]
    workers = {"p": _Worker(calls), **{t: _Worker(calls, reserve=_full(t)) for t in order}}
    cls = _ExcludingCLS(workers, order)
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4), WorkerDirectory(cls), max_attempts=1)
    with pytest.raises(Overloaded, match=f"worker t{REFUSED_TRIES - 1} cannot take the request: .*no KV room"):
        asyncio.run(run.admit())
    assert len(cls.excluded) == REFUSED_TRIES == run.refusals and calls == ["reserve"] * REFUSED_TRIES


class _Feed:
    """`handle.feed.remote(subscriber)`: sends `batches` of (request id, delta), then stays open."""

    def __init__(self, *batches):
        self.batches = batches

    def remote(self, subscriber):
        async def feed():
            for batch in self.batches:
                answer = asyncio.get_running_loop().create_future()
                answer.set_result(batch)
                yield answer
            await asyncio.Event().wait()
        return feed()


async def _read_until_final(run: Run) -> list[int]:
    """As a response does: reads deltas until the final one, and no further."""
    await run.admit()
    tokens = []
    async for delta in run.deltas():
        tokens += delta.token_ids
        if delta.finish_reason:
            break
    await asyncio.sleep(0.01)  # the best-effort calls in the background
    return tokens


@pytest.mark.parametrize("first_final", [False, True])
def test_a_request_that_ends_leaves_no_queue_in_the_token_feeds(first_final):
    """Its deltas' queue goes before the caller sees the final one (a caller reads no further):
    after the token worker's last delta, or a first token that already ends it (then the token
    worker is told to drop its reservation). The prompt's cache hit is the prefill's, not the
    token worker's import's."""
    calls: list = []
    first = TokenDelta((4,), "length" if first_final else None, cached_tokens=16)
    workers = {"p": _Worker(calls, prefill=first), "t": _Worker(calls, reserve="ticket")}
    workers["t"].feed = _Feed([("r.0", TokenDelta((4, 5), cached_tokens=0))], [("r.0", TokenDelta((6,), "length"))])
    directory = WorkerDirectory(_PlacingCLS(workers))
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=1 if first_final else 3), directory, max_attempts=1)
    assert asyncio.run(_read_until_final(run)) == ([4] if first_final else [4, 5, 6])
    assert run.cached_tokens == 16
    assert directory.feeds._queues == {"t": {}}
    assert calls == ["reserve", "prefill"] + ["abort"] * first_final


class _DyingCLS(_PlacingCLS):
    """Places the first attempt; then it is dead (its controller replica stopped)."""

    def __init__(self, workers: dict):
        super().__init__(workers)
        self.placements = [Placement("p", "t"), ActorDiedError()]
        self.place = self

    def remote(self, *args):
        if len(args) == 1:
            return super().remote(*args)
        answer = asyncio.get_running_loop().create_future()
        placement = self.placements.pop(0)
        answer.set_exception(placement) if isinstance(placement, BaseException) else answer.set_result(placement)
        return answer


@pytest.mark.parametrize("at_failover", [False, True])
def test_a_dead_cls_fails_the_request_as_a_503_and_marks_the_directory_dead(at_failover):
    """At admission, or when the failover of a request whose prompt worker died (with the CLS) asks
    it for new workers: a RequestFailed naming it (a 503), never Ray's ActorDiedError (a 500)."""
    calls: list = []
    workers = {"p": _Worker(calls, prefill=ActorDiedError()), "t": _Worker(calls, reserve="ticket")}
    cls = _DyingCLS(workers)
    if not at_failover:
        cls.placements.pop(0)
    directory = WorkerDirectory(cls)
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=4), directory, max_attempts=3)

    async def drive():
        await run.admit()
        return [delta async for delta in run.deltas()]

    with pytest.raises(RequestFailed, match="cluster controller .CLS. died") as failed:
        asyncio.run(drive())
    assert failed.value.as_error().status == 503 and directory.dead
    assert run.failures == at_failover


def test_no_worker_ready_refuses_a_new_request_and_a_failover_waits_for_one(monkeypatch):
    monkeypatch.setattr(dispatch, "REPLACE_WAIT_S", 0.01)
    unavailable = RayTaskError("place", "traceback", ClusterUnavailable("no worker is ready yet"))
    calls: list = []
    workers = {"p": _Worker(calls, prefill=ActorDiedError()), "t": _Worker(calls, reserve="ticket"),
               "p2": _Worker(calls, prefill=TokenDelta((4,), "length")), "t2": _Worker(calls, reserve="ticket")}
    cls = _DyingCLS(workers)
    cls.placements = [unavailable]
    refused = Run("r", [1, 2, 3], SamplingParams(max_tokens=1), WorkerDirectory(cls), max_attempts=3)
    with pytest.raises(ClusterUnavailable, match="no worker is ready") as caught:
        asyncio.run(refused.admit())
    assert isinstance(caught.value, Overloaded)  # what a batch line waits on

    cls.placements = [Placement("p", "t"), unavailable, unavailable, Placement("p2", "t2")]
    run = Run("r", [1, 2, 3], SamplingParams(max_tokens=1), WorkerDirectory(cls), max_attempts=3)

    async def drive():
        await run.admit()
        return [delta async for delta in run.deltas()]

    assert [delta.token_ids for delta in asyncio.run(drive())] == [(4,)]
    assert run.failures == 1 and not cls.placements
