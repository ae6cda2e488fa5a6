"""The workers a CLS runs, by worker id: each one's handle, actors and pool slot, and what its next
load report must carry (`Worker.report`): a full prefix snapshot where its last delta may be lost
(a poll that got no answer) or the index starts empty (an adopted worker), the workers removed since
its last report (to let go of their transfer links), and for an adopted worker the live ones (its
peers may have died while no CLS ran)."""
from __future__ import annotations

from splitserve.cluster.worker_group import WorkerActors
from splitserve.config import PoolConfig


class WorkerRegistry:
    def __init__(self):
        self.handles: dict[str, object] = {}
        self.slots: dict[str, tuple[PoolConfig, int]] = {}
        self.actors: dict[str, WorkerActors] = {}  # each worker's actors (all its ranks)
        self._resync: set[str] = set()  # workers whose next report must be a prefix snapshot
        self._gone: dict[str, set[str]] = {}  # per worker: workers removed since its last report
        self._unsynced: set[str] = set()  # adopted workers yet to be told the live workers

    def add(self, worker_id: str, pool: PoolConfig, slot: int, actors: WorkerActors, adopted: bool = False) -> None:
        self.handles[worker_id], self.slots[worker_id], self.actors[worker_id] = actors.handle, (pool, slot), actors
        if adopted:
            self._resync.add(worker_id)
            self._unsynced.add(worker_id)

    def remove(self, worker_id: str) -> tuple[PoolConfig, int, WorkerActors] | None:
        """Its slot and actors (to stop); None if it was removed already (a retire and a failure raced)."""
        if worker_id not in self.slots:
            return None
        self.handles.pop(worker_id, None)
        self._resync.discard(worker_id)
        self._unsynced.discard(worker_id)
        self._gone.pop(worker_id, None)
        for other in self.slots:
            if other != worker_id:
                self._gone.setdefault(other, set()).add(worker_id)
        pool, slot = self.slots.pop(worker_id)
        return pool, slot, self.actors.pop(worker_id)

    def report_args(self, worker_id: str) -> tuple[bool, tuple[str, ...], tuple[str, ...] | None]:
        """(a prefix snapshot?, the workers gone since its last report, the live ones or None) for
        its next report; the gone ones are handed over once."""
        gone = tuple(sorted(self._gone.pop(worker_id, ())))
        return worker_id in self._resync, gone, tuple(sorted(self.slots)) if worker_id in self._unsynced else None

    def reported(self, worker_id: str) -> None:
        self._resync.discard(worker_id)
        self._unsynced.discard(worker_id)

    def report_lost(self, worker_id: str) -> None:
        """A report not answered still runs there, and its delta is lost: the next is a snapshot."""
        self._resync.add(worker_id)
