"""What the ingress asks the CLS for a request (no Ray: a stand-in CLS and workers): the prompt's
block hashes for prefix-aware placement, which are the ones the engines' block managers cache; and
an attempt whose prompt worker refuses the ticket."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayTaskError

from splitserve.cluster.dispatch import Overloaded, RequestFailed, Run, WorkerDirectory
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.prefix_hash import PrefixNaming
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement import Placement
from splitserve.transfer.link import TransferError
from tests.engine.block_helpers import cached


class _CLS:
    """Refuses every placement, keeping the requests it was asked to place."""

    def __init__(self):
        self.requests = []
        self.place = self

    def remote(self, request, exclude):
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

    def remote(self, *args):
        self.calls.append(self.name)
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
