"""Jobs as Ray tasks: a local Ray using every core of this machine, or an existing cluster's."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import ray

from splitserve.jobs import Job, Runner, SerialRunner


class RayRunner(Runner):
    """Each job a Ray task of `num_cpus`; joins the Ray at `address` (None: starts a local one
    with every core of this machine). `slots`: default, as many tasks as the cluster's CPUs fit."""

    def __init__(self, address: str | None = None, num_cpus: float = 1.0, slots: int | None = None):
        if not ray.is_initialized():
            local = {"include_dashboard": False} if address is None else {}
            ray.init(address=address, log_to_driver=False, **local)
        self.slots = slots or max(1, int(ray.cluster_resources().get("CPU", 1) // num_cpus))
        self._task = ray.remote(num_cpus=num_cpus, max_retries=0)(_call)

    def _submit(self, job: Job):
        return self._task.remote(job.fn, job.args)

    def _next_done(self, handles: list):
        ready, _ = ray.wait(handles, num_returns=1)
        return ready[0], ray.get(ready[0])


def _call(fn: Callable, args: tuple) -> Any:
    return fn(*args)


def make_runner(args: argparse.Namespace) -> Runner:
    """The runner `splitserve.jobs.add_runner_arguments`' flags ask for."""
    if args.serial and args.address:
        raise ValueError("--serial runs in this process: it cannot take --address")
    return SerialRunner() if args.serial else RayRunner(args.address)
