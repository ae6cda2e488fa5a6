"""A new CLS adopting the workers a dead one left (Serve replaced the controller): they keep
serving what they run, and the new CLS starts only the slots nobody fills.

A worker is adopted when the config has its slot (role and slot number), it runs this very config
(`ClusterConfig.digest`), it joined this app's rendezvous store (so it can reach the workers the
new CLS starts), all its ranks are alive, and no newer incarnation fills its slot. It goes back to
its home pool (the policy moves it again if it must). Any other is stopped: it could not serve;
so are the other ranks of a worker whose rank 0 is gone."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ray.exceptions import RayError

from splitserve.cluster.worker_group import NamedWorker, WorkerActors, find_workers, stop_strays
from splitserve.config import ClusterConfig, PoolConfig
from splitserve.placement.state import WorkerLoad

log = logging.getLogger("splitserve.controller")
INFO_TIMEOUT_S = 10.0  # a worker still loading its model (its start was cut short) is not waited for


@dataclass
class Adopted:
    found: NamedWorker
    pool: PoolConfig
    actors: WorkerActors
    load: WorkerLoad


async def adopt_workers(app: str, config: ClusterConfig, rendezvous) -> tuple[list[Adopted], int]:
    """The workers adopted, and the newest incarnation found (-1: none). Ranks whose rank 0 is
    gone are stopped."""
    for name in stop_strays(app):
        log.warning("%s: its worker's rank 0 is gone; it stops", name)
    found = find_workers(app)
    newest = {(w.role, w.slot): w for w in found}  # `found` is oldest first: the newest per slot stays
    adopted = await asyncio.gather(*(_adopt(w, config, rendezvous, newest[w.role, w.slot] is not w) for w in found))
    return [a for a in adopted if a is not None], max((w.incarnation for w in found), default=-1)


async def _adopt(found: NamedWorker, config: ClusterConfig, rendezvous, superseded: bool) -> Adopted | None:
    pool = next((p for p in config.pools if p.role == found.role), None)
    try:
        actors = WorkerActors.find(found.name, pool.tensor_parallel_size if pool else 1)
    except ValueError:  # gone since it was listed
        return None
    why_not = "a newer worker fills its slot" if superseded else None
    try:
        if why_not is None:
            info = await asyncio.wait_for(actors.handle.info.remote(), INFO_TIMEOUT_S)
            why_not = _why_not(found, pool, config, rendezvous, info, 1 + len(actors.shards))
        if why_not is None:
            await actors.handle.set_role.remote(pool.role)
            adopted = Adopted(found, pool, actors, await actors.handle.load.remote())
            log.info("worker %s adopted (%s, %s)", found.worker_id, pool.role, pool.hardware)
            return adopted
    except (RayError, asyncio.TimeoutError) as error:
        why_not = f"it did not answer ({error!r})"
    log.warning("worker %s is not adopted: %s; it stops", found.worker_id, why_not)
    actors.kill()
    return None


def _why_not(found: NamedWorker, pool: PoolConfig | None, config: ClusterConfig, rendezvous, info: dict,
             ranks: int) -> str | None:
    if pool is None or found.slot >= pool.num_workers:
        return "the config has no such slot"
    if info["config_digest"] != config.digest():
        return "it runs another config"
    if info["rendezvous"] != (list(rendezvous[:2]) if rendezvous else None):
        return "it joined another rendezvous store"
    if ranks != pool.tensor_parallel_size:
        return f"{pool.tensor_parallel_size - ranks} of its ranks are gone"
    return None
