"""Runners: many searches driven at once give each the answer it gets alone, whatever order jobs
finish in; a plan is the same serial, on a runner that finishes jobs out of order, and on Ray tasks."""
import argparse
import math

import pytest

from splitserve.provision.runner import Job, RayRunner, Runner, SerialRunner, make_runner
from splitserve.provision.search import Goal, TraceSpec, search
from splitserve.sim.designs import DESIGNS


class Shuffled(Runner):
    """Runs each job at once but hands finished ones back newest first, `slots` at a time."""

    def __init__(self, slots: int):
        self.slots, self._done, self._count = slots, {}, 0

    def _submit(self, job: Job) -> int:
        self._count += 1
        self._done[self._count] = job.fn(*job.args)
        return self._count

    def _next_done(self, handles: list):
        newest = max(handles)
        return newest, self._done.pop(newest)


def halving(start: float):
    """A search that asks for the square root of its value until it is 2 or less; answers how many it asked."""
    asked, value = 0, start
    while value > 2:
        value = yield Job(math.sqrt, (value,))
        asked += 1
    return asked


@pytest.mark.parametrize("runner", [SerialRunner(), Shuffled(3)], ids=["serial", "shuffled"])
def test_each_search_gets_its_own_answer(runner):
    seen = []
    assert runner.drive([halving(2.0 ** 16), halving(1.0), halving(9.0)], seen.append) == [4, 0, 2]
    assert sorted(seen) == sorted([256.0, 16.0, 4.0, 2.0, 3.0, math.sqrt(3.0)])
    assert runner.map([Job(math.sqrt, (x,)) for x in (4.0, 9.0, 16.0)]) == [2.0, 3.0, 4.0]


def test_a_search_that_fails_raises():
    with pytest.raises(ValueError, match="math domain error"):
        SerialRunner().map([Job(math.sqrt, (-1.0,))])


def test_serial_and_an_address_are_refused_together():
    with pytest.raises(ValueError, match="--serial .* --address"):
        make_runner(argparse.Namespace(serial=True, address="ray://head:10001"))
    assert isinstance(make_runner(argparse.Namespace(serial=True, address=None)), SerialRunner)


BUDGET = Goal("iso-power", 176.0, step=1)                        # 4 H100s: splits (3, 1), (2, 2), (1, 3)
CHEAPEST = Goal("iso-throughput", 176.0, 2.0, "power", step=1)  # the least power that serves 2 req/s
TRACE = TraceSpec("conv", 4.0)


@pytest.mark.parametrize("goal", [BUDGET, CHEAPEST], ids=["iso-power", "iso-throughput"])
def test_the_plan_does_not_depend_on_the_runner(goal):
    serial = search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2)
    assert serial.best is not None
    assert search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2, runner=Shuffled(3)) == serial


def test_a_plan_on_ray_tasks_equals_the_serial_one(head_node):
    runner = RayRunner(num_cpus=0.01, slots=2)  # the session's head gives its CPUs to the apps
    for goal in (BUDGET, CHEAPEST):
        seen = []
        plan = search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2, progress=seen.append, runner=runner)
        assert plan == search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2) and seen
