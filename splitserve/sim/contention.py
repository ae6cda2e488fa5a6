"""Workers that share one host's cores (a local CPU cluster), as processor sharing.

While k other workers of the host are in an iteration, a worker's iteration advances at
1 / (1 + peer_slowdown x k) of its speed alone. Its work (the iteration's time alone) is fixed when
it starts, so its end moves whenever another worker starts or ends an iteration. A host with a core
per worker and nothing else running has peer_slowdown 0; one whose cores are saturated by the
workers' threads plus a steady background demand of b cores slows each by 1 / (1 + b) per other
busy worker. `splitserve profile --url` measures it (`splitserve.sim.overhead`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass
class _Run:
    started: float
    work_left: float  # seconds of work at the speed alone
    since: float      # when work_left was last brought up to date
    version: int = 0


class SharedHost:
    """The iterations in flight on one host. Every `start` and `finish` returns the new
    (worker id, end time, version) of each iteration still in flight; an end whose version is no
    longer `current` was moved and must be ignored."""

    def __init__(self, peer_slowdown: float):
        if not peer_slowdown > 0:
            raise ValueError(f"peer_slowdown must be > 0 for a shared host, got {peer_slowdown!r}")
        self.peer_slowdown = peer_slowdown
        self._runs: dict[str, _Run] = {}
        self._versions = itertools.count(1)

    def start(self, worker_id: str, work_s: float, now: float) -> list[tuple[str, float, int]]:
        if worker_id in self._runs:
            raise RuntimeError(f"worker {worker_id} started an iteration while one is in flight")
        self._advance(now)
        self._runs[worker_id] = _Run(now, work_s, now)
        return self._ends(now)

    def finish(self, worker_id: str, now: float) -> tuple[float, list[tuple[str, float, int]]]:
        """The iteration of `worker_id` ended at `now`: how long it took, and the others' new ends."""
        self._advance(now)
        run = self._runs.pop(worker_id)
        return now - run.started, self._ends(now)

    def current(self, worker_id: str, version: int) -> bool:
        run = self._runs.get(worker_id)
        return run is not None and run.version == version

    def _rate(self) -> float:
        return 1.0 / (1.0 + self.peer_slowdown * max(0, len(self._runs) - 1))

    def _advance(self, now: float) -> None:
        rate = self._rate()
        for run in self._runs.values():
            run.work_left -= (now - run.since) * rate
            run.since = now

    def _ends(self, now: float) -> list[tuple[str, float, int]]:
        rate, ends = self._rate(), []
        for worker_id, run in self._runs.items():
            run.version = next(self._versions)
            ends.append((worker_id, now + max(0.0, run.work_left) / rate, run.version))
        return ends
