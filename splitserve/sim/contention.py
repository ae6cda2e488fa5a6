"""Workers that share one host's cores with the serving stack (a local CPU cluster), as processor
sharing.

The host has `cores` cores. Each worker in an iteration is one runnable thread; so is the serving
stack around the workers (Serve's proxy, the ingress, the CLS, the clients) while it has work: every
token the workers sample gives it `stream_cpu_s` seconds of CPU (streaming the token out); and so
is each arriving request's path through the stack until it reaches the workers (`request_run`).
While n of them are runnable each advances at min(1, cores / n) of its speed alone. An iteration's work (its
time alone) is fixed when it starts, so its end moves whenever a worker starts or ends an iteration
or the stack starts or runs out of work. `splitserve profile --url --shared-host` measures both
terms (`splitserve.sim.serving_profile`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

STACK = "serving stack"  # the stack's run; no worker id has a space


def request_run(index: int) -> str:
    """The run id of request `index`'s path through the stack (a space: never a worker's id)."""
    return f"request {index}"


@dataclass
class _Run:
    started: float
    work_left: float  # seconds of work at the speed alone
    since: float      # when work_left was last brought up to date
    version: int = 0


class SharedHost:
    """The runs in flight on one host: the workers' iterations and the stack's backlog. Every
    `start` and `finish` returns the new (run id, end time, version) of each run still in flight
    (the stack's id is `STACK`); an end whose version is no longer `current` was moved and must be
    ignored."""

    def __init__(self, cores: float, stream_cpu_s: float = 0.0):
        if not cores > 0:
            raise ValueError(f"cores must be > 0 for a shared host, got {cores!r}")
        self.cores, self.stream_cpu_s = cores, stream_cpu_s
        self._runs: dict[str, _Run] = {}
        self._versions = itertools.count(1)

    def start(self, worker_id: str, work_s: float, now: float) -> list[tuple[str, float, int]]:
        if worker_id in self._runs:
            raise RuntimeError(f"worker {worker_id} started an iteration while one is in flight")
        self._advance(now)
        self._runs[worker_id] = _Run(now, work_s, now)
        return self._ends(now)

    def finish(self, run_id: str, now: float, tokens: int = 0) -> tuple[float, list[tuple[str, float, int]]]:
        """The run `run_id` ended at `now` after sampling `tokens` tokens (which the stack streams
        out): how long it took, and the others' new ends."""
        self._advance(now)
        run = self._runs.pop(run_id)
        work = tokens * self.stream_cpu_s
        if work > 0:
            stack = self._runs.get(STACK)
            if stack is None:
                self._runs[STACK] = _Run(now, work, now)
            else:
                stack.work_left += work
        return now - run.started, self._ends(now)

    def current(self, run_id: str, version: int) -> bool:
        run = self._runs.get(run_id)
        return run is not None and run.version == version

    def _rate(self) -> float:
        return min(1.0, self.cores / max(1, len(self._runs)))

    def _advance(self, now: float) -> None:
        rate = self._rate()
        for run in self._runs.values():
            run.work_left -= (now - run.since) * rate
            run.since = now

    def _ends(self, now: float) -> list[tuple[str, float, int]]:
        rate, ends = self._rate(), []
        for run_id, run in self._runs.items():
            run.version = next(self._versions)
            ends.append((run_id, now + max(0.0, run.work_left) / rate, run.version))
        return ends
