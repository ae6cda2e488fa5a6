"""The cluster-level scheduler (CLS, Splitwise IV-A), one Ray actor per app: it owns the workers,
their pools and the one placement state every ingress replica asks.

- Workers are Ray actors it creates per pool (resources from the pool's config), named
  `<role>-<slot>.<incarnation>` (the actor: `<app>-<worker id>`): a replacement gets a new
  incarnation, hence fresh transfer links.
- Adoption: workers and the rendezvous store are detached actors, so they outlive a CLS that dies.
  The next one (Ray restarts a crashed CLS in place; Serve replaces the controller of one killed)
  adopts the workers it finds (`adoption`) that run its config and store, with the requests they
  run: each goes back to its home pool and first reports a full prefix snapshot; the empty slots
  get new workers. It is ready at once with adopted workers. Workers no CLS calls stop themselves
  (`orphan_lease`).
- Load: it polls every worker each `report_interval_s` (a report per interval, not per
  iteration); the poll doubles as the liveness check. While no worker has work it polls each
  `idle_report_interval_s` instead, and a placement brings the fast cadence back at once.
  Reports drive the policy's pool moves, and carry each worker's prefix-cache delta into the
  placement's prefix index; after a poll that got no answer (whose delta may be lost), that
  worker's next report is a full snapshot.
- Placement: `place` picks both workers at once (the policy in `placement/`), moving a worker
  into the mixed pool first when the policy says so. None means the cluster cannot admit now.
- Failure: a worker that fails a call or a poll is diagnosed through `health` (`worker_health`:
  the engine loop's heartbeat, read without waiting for the loop): dead, unhealthy (its engine state broke) or
  stuck (a step past `stuck_step_s`) workers leave their pool, are killed and replaced; a worker
  merely busy with a long step stays. A replacement that fails to start is tried again, further
  apart each time (`RESTART_BACKOFF_S`), until one starts: a slot is never left empty for good.
- LoRA adapters loaded and unloaded while serving: the one table of what the cluster serves
  (`lora_updates`): `place` admits no request under an adapter it does not hold, every worker
  that starts is given the table first, and a worker whose report shows other adapters is mended.
- Drain: `retire` takes a worker out of placement, lets its running requests finish (at most
  `drain_timeout_s`), then stops it; `drain` does so for every worker on shutdown, while no
  new request is placed (the ingress answers 429).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Collection

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from splitserve.cluster.adoption import adopt_workers
from splitserve.cluster.background import background
from splitserve.cluster.dispatch import ClusterUnavailable
from splitserve.cluster.lora_updates import RunTimeAdapters
from splitserve.cluster.metrics import ClusterMetrics, RequestObservation, SLOBounds
from splitserve.cluster.rendezvous import Rendezvous, open_rendezvous
from splitserve.cluster.worker import MAX_CONCURRENT_CALLS
from splitserve.cluster.worker_actors import start_worker_actors
from splitserve.cluster.worker_group import WORKER_NAMESPACE, WorkerActors
from splitserve.cluster.worker_health import CALL_TIMEOUT_S, diagnose
from splitserve.cluster.worker_registry import WorkerRegistry
from splitserve.config import ClusterConfig, PoolConfig
from splitserve.placement import ClusterState, Placement, PlacementRequest, PoolMove
from splitserve.placement.state import Role

log = logging.getLogger("splitserve.controller")
MAX_START_ERRORS = 20  # failed starts kept (/health shows the last five): a replacement may fail again and again
RESTART_BACKOFF_S = (1.0, 60.0)  # a failed replacement is tried again after 1 s, then twice as long each time, to 60 s


class Controller:
    def __init__(self, config: dict, app_name: str = "splitserve", start_on_call: bool = False):
        """`start_on_call`: `health` and `place` start it if nobody has (a CLS Ray restarted after a
        crash runs this again, and nobody calls `start`), and answer once it has adopted its workers."""
        self.config = ClusterConfig.model_validate(config)
        self.app_name = app_name  # worker actors are named `<app>-<worker id>`
        self._start_on_call = start_on_call
        self.state = ClusterState(self.config.scheduler.policy, self.config.scheduler.thresholds(),
                                  self.config.prefix_options(), self.config.adapter_options())
        self.workers = WorkerRegistry()
        slo = self.config.slo
        self.metrics = ClusterMetrics(self.config.model_name, SLOBounds(slo.ttft_s, slo.tbt_s, slo.e2e_s),
                                      self.config.served_models.adapters)
        self.counters: Counter = Counter()
        self.lora = RunTimeAdapters(self.config, self.counters)
        self.start_errors: list[str] = []
        self._incarnations = itertools.count()
        self._rendezvous: Rendezvous | None = None  # the store's address and the transfer secret
        self._store = None  # the rendezvous store's actor, where the cluster needs one
        self._store_renewed = 0.0
        self._started: asyncio.Task | None = None
        self._adopted = asyncio.Event()  # set once the workers a dead CLS left are adopted (or none were)
        self._ready = False
        self._draining = False
        self._retiring: set[str] = set()
        self._placed = asyncio.Event()  # set by a placement; cleared when a poll begins

    @property
    def handles(self) -> dict[str, object]:
        return self.workers.handles

    @property
    def slots(self) -> dict[str, tuple[PoolConfig, int]]:
        return self.workers.slots

    @property
    def _poll_timeout_s(self) -> float:
        """A poll waits for the step in progress; past the stuck bound, the worker's health says why."""
        return min(CALL_TIMEOUT_S, self.config.scheduler.stuck_step_s)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt or start every pool's workers in the background; `health` says when they are up."""
        if self._started is None:
            self._started = background(self._start_all())

    async def _adoption(self) -> None:
        """With `start_on_call`: started, and past adoption (bounded)."""
        if not self._start_on_call:
            return
        await self.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._adopted.wait(), CALL_TIMEOUT_S)

    async def _start_all(self) -> None:
        """Adopt what a dead CLS left, then start every empty slot while polling the workers up."""
        if self.config.needs_rendezvous:
            try:
                self._store, self._rendezvous = await open_rendezvous(
                    self.app_name, self.config.transfer.timeout_s, self.config.scheduler.orphan_timeout_s)
            except RayError as error:  # no worker can start: /health says why
                self.start_errors.append(f"rendezvous store: {error}")
                log.error("the rendezvous store did not start: %s", error)
                self._adopted.set()
                return
        await self._adopt_all()
        self._adopted.set()
        self._ready = bool(self.handles)
        polling = background(self._poll_forever())
        taken = {(pool.role, slot) for pool, slot in self.slots.values()}
        await asyncio.gather(*(self._start_worker(pool, slot) for pool in self.config.pools
                               for slot in range(pool.num_workers) if (pool.role, slot) not in taken))
        self._ready = bool(self.handles)
        await polling

    async def _start_worker(self, pool: PoolConfig, slot: int) -> bool:
        """Whether a worker started in the slot; when not, /health says why (the model does not
        load, its device's memory is still held by the worker it replaces, ...)."""
        worker_id = f"{pool.role}-{slot}.{next(self._incarnations)}"
        options = {**pool.resources.ray_options(), "name": f"{self.app_name}-{worker_id}", "lifetime": "detached",
                   "namespace": WORKER_NAMESPACE, "max_concurrency": MAX_CONCURRENT_CALLS, "max_restarts": 0}
        actors = None
        try:
            actors = await start_worker_actors(pool, worker_id, options, self.config.model_dump(), self._rendezvous)
            await actors.handle.info.remote()
            async with self.lora.updates:  # no adapter loaded or unloaded between its `give` and its joining
                await self.lora.give(actors.handle)
                self._add(worker_id, pool, slot, actors, await actors.handle.load.remote())
        except (RayError, asyncio.TimeoutError) as error:
            self.start_errors[:] = self.start_errors[-(MAX_START_ERRORS - 1):] + [f"{worker_id}: {error}"]
            log.error("worker %s failed to start: %s", worker_id, error)
            if actors is not None:
                actors.kill()
            return False
        log.info("worker %s up (%s, %s)", worker_id, pool.role, pool.hardware)
        return True

    async def _replace(self, pool: PoolConfig, slot: int) -> None:
        """A new worker in a slot that lost its own, tried again after each failed start (what held
        the slot may hold its device a while after it died) until one starts or the cluster drains."""
        delay, most = RESTART_BACKOFF_S
        while not await self._start_worker(pool, slot) and not self._draining:
            self.counters["failed_restarts"] += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, most)

    def _add(self, worker_id: str, pool: PoolConfig, slot: int, actors: WorkerActors, load,
             adopted: bool = False) -> None:
        self.workers.add(worker_id, pool, slot, actors, adopted)
        self.state.add_worker(worker_id, Role(pool.role), self.config.worker_hardware(pool), load, time.monotonic())

    async def _adopt_all(self) -> None:
        adopted, newest = await adopt_workers(self.app_name, self.config, self._rendezvous)
        self._incarnations = itertools.count(newest + 1)  # worker ids are never reused
        for worker in adopted:
            self._add(worker.found.worker_id, worker.pool, worker.found.slot, worker.actors, worker.load, adopted=True)
            self.counters["workers_adopted"] += 1
        await self.lora.adopt({worker.found.worker_id: worker.actors.handle for worker in adopted})

    async def health(self) -> dict:
        """Ready once workers are up and passed their last poll (which goes through each engine
        loop), and not while draining."""
        await self._adoption()
        pools = self.state.pools()
        return {"ready": self._ready and bool(self.state.workers) and not self._draining,
                "draining": self._draining, "workers": len(self.state.workers),
                "pools": {role.value: len(ids) for role, ids in pools.items()}, "errors": self.start_errors[-5:]}

    # ---- placement -------------------------------------------------------------------------
    async def place(self, request: PlacementRequest, exclude: Collection[str] = (),
                    lora: str | None = None) -> Placement | None:
        """Worker ids only: handles are costly to send, so callers cache them (`worker_handle`).
        None when no worker has room; ClusterUnavailable when none is ready or the cluster drains;
        AdapterUnavailable when the request's LoRA adapter `lora` is not served (any more); else the
        placement names the adapter's identity, which the workers check (`SamplingParams.lora_identity`)."""
        await self._adoption()
        identity = self.lora.check(lora)
        if self._draining:
            raise ClusterUnavailable("the cluster is shutting down: it finishes what it runs and takes no new "
                                     "requests")
        if not (self._ready and self.state.workers):
            raise ClusterUnavailable("no worker is ready yet (the cluster is starting, or replacing its workers)")
        if identity is not None:
            request = dataclasses.replace(request, lora=identity)
        placement, moves = self.state.place(request, time.monotonic(), exclude)
        if identity is not None:
            self.metrics.record_adapter_placements(self.state.adapter_placements)
        self._placed.set()
        await self._apply(moves)
        if placement is None:
            self.counters["rejected"] += 1
            return None
        return placement if identity is None else dataclasses.replace(placement, lora_identity=identity)

    # ---- LoRA adapters -------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Load an adapter on every worker (LoraUpdateError if one refuses: none keeps it)."""
        await self._adoption()
        await self.lora.load(self.handles, name, path)

    async def unload_lora(self, name: str) -> None:
        await self._adoption()
        await self.lora.unload(self.handles, name)

    async def lora_table(self) -> dict[str, str]:
        """The adapters served, name -> identity, for the ingress replicas."""
        await self._adoption()
        return self.lora.table()

    async def _apply(self, moves: list[PoolMove]) -> None:
        """Switch the moved workers' engines to their new pool's role (before they get work)."""
        for move in moves:
            self.counters["repurposings" if move.repurposed else f"moves_to_{move.to_pool.value}"] += 1
            worker = self.state.workers[move.worker_id]  # the move is applied: into MIXED keeps the home
            self.metrics.record_transition(worker.home if move.to_pool is Role.MIXED else Role.MIXED, move.to_pool)
            log.info("pool move: %s -> %s (%s)", move.worker_id, move.to_pool.value, move.reason)
            try:
                await self.handles[move.worker_id].set_role.remote(move.to_pool.value)
            except RayActorError:
                await self.worker_failed(move.worker_id)

    # ---- load reports and failures -----------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            self._placed.clear()
            self._renew_store()
            polled = list(self.handles)
            results = await asyncio.gather(*(self._poll(w) for w in polled), return_exceptions=True)
            for worker_id, result in zip(polled, results):
                if isinstance(result, Exception):  # a bug in handling one report must not end every poll
                    self._poll_error(f"report of {worker_id}", result)
            try:
                self.metrics.record_pools({w.worker_id: (w.pool, w.hardware.name)
                                           for w in self.state.workers.values()})
            except Exception as error:
                self._poll_error("pool sizes", error)
            await self._until_next_poll(started)

    async def _until_next_poll(self, started: float) -> None:
        """The fast cadence while anything runs or was placed during the poll; otherwise the idle
        one, cut short by a placement (then one fast interval on, so that the request has reached
        its workers when they report)."""
        scheduler = self.config.scheduler
        if self._placed.is_set() or not self.state.idle():
            await asyncio.sleep(max(0.0, scheduler.report_interval_s - (time.monotonic() - started)))
            return
        try:
            await asyncio.wait_for(self._placed.wait(), scheduler.idle_report_interval_s - (time.monotonic() - started))
        except asyncio.TimeoutError:
            return
        await asyncio.sleep(scheduler.report_interval_s)

    def _renew_store(self) -> None:
        """The rendezvous store's orphan lease, renewed a few times per lease (its answer unread)."""
        if self._store is not None and time.monotonic() - self._store_renewed > \
                self.config.scheduler.orphan_timeout_s / 8:
            self._store_renewed = time.monotonic()
            self._store.address.remote()

    def _poll_error(self, what: str, error: Exception) -> None:
        self.counters["poll_errors"] += 1
        log.error("handling the %s failed; polling goes on", what, exc_info=error)

    async def _poll(self, worker_id: str) -> None:
        handle = self.handles.get(worker_id)
        if handle is None or worker_id in self._retiring:
            return
        try:
            load, stats, prefix, adapters = await asyncio.wait_for(
                handle.report.remote(*self.workers.report_args(worker_id)), self._poll_timeout_s)
        except (RayError, asyncio.TimeoutError):  # dead, unhealthy (the loop refuses), or slow
            self.workers.report_lost(worker_id)
            await self.worker_failed(worker_id)
            return
        self.workers.reported(worker_id)
        self.lora.mend(worker_id, handle, adapters)
        await self._apply(self.state.report(worker_id, load, time.monotonic(), prefix))
        worker = self.state.workers.get(worker_id)
        if worker is not None:
            self.metrics.record_worker(worker_id, worker.pool, worker.hardware.name, load, stats)

    async def worker_failed(self, worker_id: str) -> None:
        """A worker failed a call or a poll: if it is dead, unhealthy or stuck, it leaves its pool,
        is stopped and is replaced; a worker busy with a long step stays."""
        handle = self.handles.get(worker_id)
        if handle is None:
            return
        verdict = await diagnose(handle, self.config.scheduler.stuck_step_s)
        if verdict is None or worker_id not in self.handles:
            return
        self.counters["worker_failures"] += 1
        self.metrics.worker_failures.inc()
        log.warning("worker %s is %s; it leaves its pool", worker_id, verdict)
        self._remove(worker_id, replace=self.config.scheduler.replace_dead_workers)  # its streams fail over

    def _remove(self, worker_id: str, replace: bool) -> None:
        """Out of the pools, stopped; `replace`: a new worker in its slot."""
        removed = self.workers.remove(worker_id)
        if removed is None:  # already removed (a retire and a failure raced)
            return
        pool, slot, actors = removed
        self.lora.forget(worker_id)
        if worker_id in self.state.workers:
            self.state.remove_worker(worker_id)
        self.metrics.remove_worker(worker_id)
        actors.kill()
        if replace and not self._draining:
            self.counters["worker_replacements"] += 1
            background(self._replace(pool, slot))

    # ---- drain -------------------------------------------------------------------------------
    async def retire(self, worker_id: str, replace: bool = True) -> dict:
        """Take a worker out of placement, let what runs on it finish (at most drain_timeout_s;
        the rest fails over when it stops), then stop it; `replace` starts a new one in its slot."""
        handle = self.handles.get(worker_id)
        if handle is None or worker_id in self._retiring:
            raise KeyError(f"no worker {worker_id!r} in the pools")
        self._retiring.add(worker_id)
        self.state.remove_worker(worker_id)
        deadline = time.monotonic() + self.config.scheduler.drain_timeout_s
        left = await self._in_flight(handle)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            left = await self._in_flight(handle)
        self._retiring.discard(worker_id)
        self.counters["workers_retired"] += 1
        log.info("worker %s retired (%d requests still running)", worker_id, left)
        self._remove(worker_id, replace)
        return {"worker_id": worker_id, "unfinished": left}

    async def drain(self) -> dict:
        """Shutdown: refuse new requests, let every worker finish what it runs, then stop them
        and the rendezvous store."""
        self._draining = True
        retired = await asyncio.gather(*(self.retire(w, replace=False) for w in list(self.handles)),
                                       return_exceptions=True)
        if self._store is not None:
            ray.kill(self._store, no_restart=True)
        return {"unfinished": sum(r["unfinished"] for r in retired if isinstance(r, dict))}

    async def _in_flight(self, handle) -> int:
        try:
            return await asyncio.wait_for(handle.in_flight.remote(), CALL_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError, GetTimeoutError):
            return 0  # gone: nothing more will finish there

    # ---- introspection -----------------------------------------------------------------------
    async def status(self) -> dict:
        return {**self.state.snapshot(), "model": self.config.model_name, "ready": self._ready,
                "counters": dict(self.counters), "lora_adapters": self.lora.listing()}

    async def record_requests(self, observations: list[RequestObservation]) -> None:
        self.metrics.record_requests(observations)

    async def metrics_text(self) -> bytes:
        """The cluster's metrics in Prometheus text format."""
        return self.metrics.render()

    async def worker_handle(self, worker_id: str):
        return self.handles.get(worker_id)
