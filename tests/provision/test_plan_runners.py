"""A plan is the same serial and on a runner that finishes its jobs out of order (Ray tasks:
tests/cluster/ray/test_task_runner.py)."""
import pytest

from splitserve.provision.search import Goal, TraceSpec, search
from splitserve.sim.designs import DESIGNS
from tests.test_jobs import Shuffled

BUDGET = Goal("iso-power", 176.0, step=1)                        # 4 H100s: splits (3, 1), (2, 2), (1, 3)
CHEAPEST = Goal("iso-throughput", 176.0, 2.0, "power", step=1)  # the least power that serves 2 req/s
TRACE = TraceSpec("conv", 4.0)


@pytest.mark.parametrize("goal", [BUDGET, CHEAPEST], ids=["iso-power", "iso-throughput"])
def test_the_plan_does_not_depend_on_the_runner(goal):
    serial = search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2)
    assert serial.best is not None
    assert search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2, runner=Shuffled(3)) == serial
