"""Jobs as Ray tasks: a small plan on the session's cluster equals the serial one; the flags that
pick a runner refuse to be combined."""
import argparse

import pytest

from splitserve.cluster.task_runner import RayRunner, make_runner
from splitserve.jobs import SerialRunner
from splitserve.provision.search import search
from splitserve.sim.designs import DESIGNS
from tests.provision.test_plan_runners import BUDGET, CHEAPEST, TRACE


def test_serial_and_an_address_are_refused_together():
    with pytest.raises(ValueError, match="--serial .* --address"):
        make_runner(argparse.Namespace(serial=True, address="ray://head:10001"))
    assert isinstance(make_runner(argparse.Namespace(serial=True, address=None)), SerialRunner)


def test_a_plan_on_ray_tasks_equals_the_serial_one(head_node):
    runner = RayRunner(num_cpus=0.01, slots=2)  # the session's head gives its CPUs to the apps
    for goal in (BUDGET, CHEAPEST):
        seen = []
        plan = search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2, progress=seen.append, runner=runner)
        assert plan == search(DESIGNS["splitwise-hh"], goal, TRACE, iterations=2) and seen
