"""Where a search's jobs (e.g. a provisioning search's simulations) run: one after another in this
process (`SerialRunner`), or each as a Ray task gathered as it finishes
(`splitserve.cluster.task_runner.RayRunner`, the Ray layer's).

A search is a generator: it yields a `Job` (one simulation), is sent the job's result, and returns
its answer. `drive` advances many searches at once, each with at most one job in flight, so a
search's jobs stay in the order it asks for them and its answer does not depend on where or in what
order other searches' jobs finish: the same searches give the same answers, serial or parallel.
"""
from __future__ import annotations

import argparse
import collections
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """`fn(*args)`. On Ray tasks `fn` must pickle: a module-level function (imported by name)."""

    fn: Callable
    args: tuple


Search = Generator[Job, Any, Any]


def single(job: Job) -> Search:
    """A search of one job whose answer is that job's result."""
    return (yield job)


class Runner(ABC):
    """Runs `Job`s; subclasses say where (`_submit`) and how finished ones come back (`_next_done`).
    `slots`: how many jobs run at once (more than 1: worth asking for ahead)."""

    slots: int

    def drive(self, searches: Sequence[Search], progress: Callable[[Any], None] | None = None) -> list:
        """Every search's answer, in the order given; `progress(result)` after each job."""
        answers: list = [None] * len(searches)
        pending: dict[Any, int] = {}  # a submitted job's handle -> its search

        def advance(index: int, result: Any) -> None:
            try:
                job = searches[index].send(result)
            except StopIteration as done:
                answers[index] = done.value
                return
            pending[self._submit(job)] = index

        for index in range(len(searches)):
            advance(index, None)
        while pending:
            handle, result = self._next_done(list(pending))
            if progress is not None:
                progress(result)
            advance(pending.pop(handle), result)
        return answers

    def map(self, jobs: Sequence[Job], progress: Callable[[Any], None] | None = None) -> list:
        """The jobs' results, in order."""
        return self.drive([single(job) for job in jobs], progress)

    @abstractmethod
    def _submit(self, job: Job) -> Any:
        """Start `job`; returns a handle for it."""

    @abstractmethod
    def _next_done(self, handles: list) -> tuple[Any, Any]:
        """Wait for one of `handles` to finish: (its handle, its result)."""


class SerialRunner(Runner):
    """In this process: a job runs when submitted; finished ones come back in submission order."""

    slots = 1

    def __init__(self):
        self._done: collections.deque[tuple[int, Any]] = collections.deque()  # (handle, result)
        self._handles = itertools.count()

    def _submit(self, job: Job) -> int:
        self._done.append((next(self._handles), job.fn(*job.args)))
        return self._done[-1][0]

    def _next_done(self, handles: list) -> tuple[int, Any]:
        return self._done.popleft()


def add_runner_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="run the simulations as tasks on this Ray cluster (default: a local Ray, every core)")
    p.add_argument("--serial", action="store_true", help="run the simulations one after another in this process")
