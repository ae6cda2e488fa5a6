"""The controller's poll loop outlives a failure in handling one worker's report: the other
workers' reports keep landing, and the failure is counted and logged (no Ray: stand-in handles)."""
from __future__ import annotations

import asyncio
import time

from splitserve.cluster.controller import Controller
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.placement.state import Role, WorkerLoad


class _Method:
    def __init__(self, result):
        self.result = result

    def remote(self):
        async def answer():
            return self.result
        return answer()


class _Handle:
    def __init__(self):
        self.report = _Method((WorkerLoad(), WorkerStats()))


def test_a_report_whose_handling_raises_does_not_stop_the_polls():
    config = {"pools": [{"role": "mixed", "num_workers": 2}], "scheduler": {"report_interval_s": 0.01}}
    controller = Controller(config)
    for worker_id in ("mixed-0.0", "mixed-1.1"):
        controller.handles[worker_id] = _Handle()
        controller.state.add_worker(worker_id, Role.MIXED, controller.config.hardware("cpu"), WorkerLoad(), 0.0)
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
