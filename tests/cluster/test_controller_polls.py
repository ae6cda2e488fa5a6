"""The controller's poll loop outlives a failure in handling one worker's report: the other
workers' reports keep landing, and the failure is counted and logged; it polls idle workers at the
idle cadence, busy ones at the fast one, and a placement wakes it; reports carry the workers'
prefix-cache deltas into the placement's index, and a lost report makes the next one a snapshot;
each worker's next report after a worker left names it once; it places nothing before a worker is
ready or while draining, which it says is unavailability, not a full cluster (no Ray: stand-in
handles)."""
from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.cluster.controller import Controller
from splitserve.cluster.dispatch import ClusterUnavailable
from splitserve.cluster.worker_group import WorkerActors
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.placement.state import PlacementRequest, PrefixDelta, Role, WorkerLoad
from tests.cluster.remote_method import RemoteMethod

HEALTHY = {"alive": True, "healthy": True, "reason": None, "heartbeat_age_s": 0.0, "step_running_s": 0.0}


class _Handle:
    def __init__(self, prefix: PrefixDelta | None = None, load: WorkerLoad = WorkerLoad()):
        self.report = RemoteMethod((load, WorkerStats(), prefix, None))
        self.health = RemoteMethod(HEALTHY)


def _controller(scheduler: dict, load: WorkerLoad = WorkerLoad()) -> Controller:
    """Two mixed workers behind stand-in handles that report `load`, started."""
    controller = Controller({"pools": [{"role": "mixed", "num_workers": 2}], "scheduler": scheduler})
    for worker_id in ("mixed-0.0", "mixed-1.1"):
        controller.handles[worker_id] = _Handle(load=load)
        controller.state.add_worker(worker_id, Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)
    controller._ready = True
    return controller


def test_placing_before_any_worker_is_ready_or_while_draining_is_unavailable_not_full():
    request = PlacementRequest("r1", num_prompt_tokens=8, max_tokens=4)
    starting = Controller({"pools": [{"role": "mixed"}]})
    with pytest.raises(ClusterUnavailable, match="no worker is ready"):
        asyncio.run(starting.place(request))
    draining = _controller({})
    assert asyncio.run(draining.place(request)) is not None
    draining._draining = True
    with pytest.raises(ClusterUnavailable, match="shutting down"):
        asyncio.run(draining.place(request))


def test_a_report_whose_handling_raises_does_not_stop_the_polls():
    controller = _controller({"report_interval_s": 0.01, "idle_report_interval_s": 0.01})
    recorded = []

    def record_worker(worker_id, *args):
        if worker_id == "mixed-0.0":
            raise RuntimeError("a bug in handling one report")
        recorded.append(worker_id)

    controller.metrics.record_worker = record_worker

    def polled_on() -> bool:
        return recorded.count("mixed-1.1") >= 5 and controller.counters["poll_errors"] >= 5

    async def run():
        poll = asyncio.ensure_future(controller._poll_forever())
        deadline = time.monotonic() + 10  # a loaded CI machine may poll far slower than every 10 ms
        while not polled_on() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not poll.done()
        poll.cancel()

    asyncio.run(run())
    assert polled_on()


def _polls(controller: Controller) -> int:
    return len(controller.handles["mixed-0.0"].report.calls)


async def _wait_for(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held (fails past `timeout_s`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        await asyncio.sleep(0.005)
    return time.monotonic() - started


def test_idle_workers_are_polled_at_the_idle_cadence_until_a_placement_wakes_the_poll():
    controller = _controller({"report_interval_s": 0.01, "idle_report_interval_s": 30})

    async def run():
        poll = asyncio.ensure_future(controller._poll_forever())
        await _wait_for(lambda: _polls(controller) == 1, 10)
        await asyncio.sleep(0.5)  # 50 fast intervals
        assert _polls(controller) == 1
        placement = await controller.place(PlacementRequest("r1", num_prompt_tokens=8, max_tokens=4))
        assert placement is not None
        woken_after = await _wait_for(lambda: _polls(controller) == 2, 10)  # not 30 s
        assert woken_after >= 0.01  # one fast interval on: the request reaches its workers first
        await asyncio.sleep(0.5)  # the reports say idle again: back to the idle cadence
        assert _polls(controller) == 2
        poll.cancel()

    asyncio.run(run())


def test_busy_workers_are_polled_at_the_fast_cadence():
    controller = _controller({"report_interval_s": 0.01, "idle_report_interval_s": 30},
                             WorkerLoad(num_decoding=1, decode_tokens=40))

    async def run():
        poll = asyncio.ensure_future(controller._poll_forever())
        await _wait_for(lambda: _polls(controller) >= 5, 10)
        poll.cancel()

    asyncio.run(run())


def test_reports_feed_the_prefix_index_and_a_lost_report_asks_for_a_snapshot():
    controller = Controller({"pools": [{"role": "mixed"}]})
    assert controller.state.prefix.aware
    handle = _Handle(PrefixDelta(16, 100, added=(11, 12)))
    controller.handles["mixed-0.0"] = handle
    controller.slots["mixed-0.0"] = (controller.config.pools[0], 0)
    controller.state.add_worker("mixed-0.0", Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)

    asyncio.run(controller._poll("mixed-0.0"))
    assert controller.state.prefix_index.cached_tokens((11, 12, 13)) == {"mixed-0.0": 32}
    handle.report.result = asyncio.TimeoutError()  # slow: it stays (healthy), but that delta is lost
    asyncio.run(controller._poll("mixed-0.0"))
    assert "mixed-0.0" in controller.state.workers
    handle.report.result = (WorkerLoad(), WorkerStats(), PrefixDelta(16, 100, added=(11,), snapshot=True), None)
    asyncio.run(controller._poll("mixed-0.0"))
    asyncio.run(controller._poll("mixed-0.0"))
    assert handle.report.calls == [(False, (), None), (False, (), None), (True, (), None), (False, (), None)]
    assert controller.state.prefix_index.cached_tokens((11, 12, 13)) == {"mixed-0.0": 16}


def test_without_prefix_caching_placement_is_blind():
    config = {"pools": [{"role": "mixed"}], "engine": {"enable_prefix_caching": False}}
    assert not Controller(config).state.prefix.aware
    assert not Controller({"pools": [{"role": "mixed"}], "scheduler": {"prefix_aware": False}}).state.prefix.aware


def test_the_next_report_of_every_worker_names_the_workers_removed_since_its_last():
    """So each lets go of its links to them (ids are never reused: a link to a dead peer that
    nothing is sent on would never fail, and a long-lived worker outlives many peers)."""
    controller = Controller({"pools": [{"role": "mixed", "num_workers": 3}]})
    for slot, worker_id in enumerate(("mixed-0.0", "mixed-1.1", "mixed-2.2")):
        actors = WorkerActors(_Handle())
        actors.kill = lambda: None
        controller.workers.add(worker_id, controller.config.pools[0], slot, actors)
        controller.state.add_worker(worker_id, Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)
    asyncio.run(controller._poll("mixed-0.0"))
    controller._remove("mixed-1.1", replace=False)
    controller._remove("mixed-2.2", replace=False)
    asyncio.run(controller._poll("mixed-0.0"))
    asyncio.run(controller._poll("mixed-0.0"))
    removed = ("mixed-1.1", "mixed-2.2")
    assert controller.handles["mixed-0.0"].report.calls == [(False, (), None), (False, removed, None), (False, (), None)]
    assert controller.workers._gone == {}  # nothing kept for removed workers
