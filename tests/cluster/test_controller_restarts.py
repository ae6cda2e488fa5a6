"""A worker that leaves its pool is replaced, and a replacement that fails to start (its device's
memory still held by the worker it replaces, say) is tried again, further apart each time, until
one starts; a drain stops the tries; the failures show in /health, bounded (no Ray: stand-in
actors)."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from splitserve.cluster import controller as controller_module
from splitserve.cluster.controller import MAX_START_ERRORS, Controller
from splitserve.cluster.worker_group import WorkerActors
from splitserve.placement.state import Role, WorkerLoad
from tests.cluster.remote_method import RemoteMethod

REAL_SLEEP = asyncio.sleep


class _Starts:
    """Stands in for start_worker_actors: the first `failures` workers die in their constructor."""

    def __init__(self, failures: int):
        self.failures, self.started, self.killed = failures, [], []

    async def __call__(self, pool, worker_id, options, config, rendezvous) -> WorkerActors:
        self.started.append(worker_id)
        failed = len(self.started) <= self.failures
        handle = type("Handle", (), {"info": RemoteMethod(RayActorError() if failed else {}),
                                     "load": RemoteMethod(WorkerLoad())})()
        actors = WorkerActors(handle)
        actors.kill = lambda: self.killed.append(worker_id)
        return actors


@pytest.fixture
def fast_backoff(monkeypatch):
    sleeps = []

    async def sleep(seconds):
        sleeps.append(seconds)
        await REAL_SLEEP(0)
    monkeypatch.setattr(controller_module.asyncio, "sleep", sleep)
    return sleeps


def _run(failures: int, monkeypatch, drain_after: int | None = None) -> tuple[Controller, _Starts]:
    starts = _Starts(failures)
    monkeypatch.setattr(controller_module, "start_worker_actors", starts)
    controller = Controller({"pools": [{"role": "mixed"}]})
    if drain_after is not None:
        original = controller._start_worker

        async def start_then_drain(pool, slot):
            started = await original(pool, slot)
            controller._draining = len(starts.started) >= drain_after
            return started
        controller._start_worker = start_then_drain

    async def lose_a_worker():
        lost = WorkerActors(object())
        lost.kill = lambda: None
        controller.workers.add("mixed-0.99", controller.config.pools[0], 0, lost)
        controller.state.add_worker("mixed-0.99", Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)
        controller._remove("mixed-0.99", replace=True)
        while not controller.handles and not controller._draining:
            await REAL_SLEEP(0)
    asyncio.run(asyncio.wait_for(lose_a_worker(), 30))
    return controller, starts


def test_a_failed_replacement_is_tried_again_further_apart_until_one_starts(monkeypatch, fast_backoff):
    controller, starts = _run(9, monkeypatch)
    assert starts.started == [f"mixed-0.{i}" for i in range(10)] and starts.killed == starts.started[:9]
    assert list(controller.handles) == ["mixed-0.9"] and controller.slots["mixed-0.9"][1] == 0
    assert controller.counters["worker_replacements"] == 1
    assert fast_backoff == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert controller.counters["failed_restarts"] == 9
    health = asyncio.run(controller.health())
    assert health["workers"] == 1 and [e.split(":")[0] for e in health["errors"]] == starts.started[4:9]


def test_a_drain_stops_the_tries_and_the_errors_kept_are_bounded(monkeypatch, fast_backoff):
    controller, starts = _run(10 ** 6, monkeypatch, drain_after=MAX_START_ERRORS + 5)
    assert len(starts.started) == MAX_START_ERRORS + 5 and not controller.handles
    assert len(controller.start_errors) == MAX_START_ERRORS
    assert controller.start_errors[-1].startswith(starts.started[-1])
