"""The CLS's index of the workers' LoRA adapter slots: which workers hold each adapter (their last
report's slots, plus what was placed on them since) and which have an idle slot left, so that
LoRA-aware placement scores only the workers that may beat the blind choice (affinity.py).

Invariant: it says of each worker what `WorkerState.adapter_wait` says: `holders(a)` holds it iff
its wait for `a` is 0, `idle` iff its wait for an adapter it does not hold is 1. It is
brought up to date whenever a worker's report or placements change (`ClusterState.report`, `place`).
"""
from __future__ import annotations

from collections.abc import Iterable

from splitserve.placement.state import WorkerState

NOTHING: frozenset[str] = frozenset()


class AdapterIndex:
    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}  # adapter identity -> ids of the workers holding it
        self._held: dict[str, frozenset[str]] = {}  # worker id -> the adapters it holds
        self.idle: set[str] = set()  # ids of the workers with an idle slot left

    def holders(self, identity: str) -> Iterable[str]:
        return self._holders.get(identity, NOTHING)

    def update(self, worker: WorkerState) -> None:
        """`worker`'s report or placements changed."""
        worker_id, resident = worker.worker_id, worker.load.lora_resident
        held = frozenset((*resident, *worker.placed_adapters)) if resident or worker.placed_adapters else NOTHING
        old = self._held.get(worker_id, NOTHING)
        if held != old:
            for identity in old - held:
                self._drop(identity, worker_id)
            for identity in held - old:
                self._holders.setdefault(identity, set()).add(worker_id)
            self._held[worker_id] = held
        if worker.has_idle_slot():
            self.idle.add(worker_id)
        else:
            self.idle.discard(worker_id)

    def placed(self, worker: WorkerState, identity: str) -> None:
        """`identity` was just added to `worker.placed_adapters` (what `update` would do, in O(1))."""
        worker_id = worker.worker_id
        self._held[worker_id] = self._held.get(worker_id, NOTHING) | {identity}
        self._holders.setdefault(identity, set()).add(worker_id)
        if not worker.has_idle_slot():
            self.idle.discard(worker_id)

    def remove(self, worker_id: str) -> None:
        for identity in self._held.pop(worker_id, NOTHING):
            self._drop(identity, worker_id)
        self.idle.discard(worker_id)

    def _drop(self, identity: str, worker_id: str) -> None:
        holders = self._holders[identity]
        holders.discard(worker_id)
        if not holders:
            del self._holders[identity]

    def check_integrity(self, workers: Iterable[WorkerState]) -> None:
        """Raise RuntimeError unless the index says of every worker what its state does."""
        rebuilt = AdapterIndex()
        for worker in workers:
            rebuilt.update(worker)
        if (rebuilt._holders, rebuilt.idle) != (self._holders, self.idle):
            raise RuntimeError("the adapter index disagrees with the workers' reported slots")
