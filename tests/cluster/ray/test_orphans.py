"""Workers and the rendezvous store are detached, so they outlive a CLS that dies (the hardening
tests show a new CLS adopting them); the ones no CLS calls any more stop themselves once their
orphan timeout passes: the store, and a worker with its other rank and its placement group, on the
real cluster (each named as the CLS names them, under an app of its own); and a new CLS stops the
other rank and the group of a worker whose rank 0 died while no CLS ran."""
from __future__ import annotations

import asyncio
import time

import ray
from ray.util import placement_group_table

from splitserve.cluster.rendezvous import open_rendezvous
from splitserve.cluster.worker_actors import start_worker_actors
from splitserve.cluster.worker_group import WORKER_NAMESPACE, find_workers, group_name, shard_name, stop_strays
from splitserve.config import ClusterConfig
from tests.ray_cluster import ENGINE, TINY

APP = "orphans"


def _alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=WORKER_NAMESPACE)
        return True
    except ValueError:
        return False


def _gone_within(timeout_s: float, *names: str) -> float:
    """Seconds until none of the named actors is alive."""
    started = time.monotonic()
    while any(_alive(name) for name in names):
        assert time.monotonic() - started < timeout_s, [name for name in names if _alive(name)]
        time.sleep(0.25)
    return time.monotonic() - started


def test_the_rendezvous_store_a_dead_cls_left_is_found_again_and_stops_once_orphaned(ray_cluster):
    app = f"{APP}-store"
    store, address = asyncio.run(open_rendezvous(app, 10, 2.0))
    again, same = asyncio.run(open_rendezvous(app, 10, 2.0))  # a new CLS: the same store, port and secret
    assert again._actor_id == store._actor_id and same == address and len(address[2]) >= 32
    assert 1.5 <= _gone_within(15, f"{app}-rendezvous")


def _tp2_worker(app: str, worker_id: str, orphan_timeout_s: float):
    """A mixed worker of 2 ranks, named as `app`'s CLS names them, once up; its rank 0's name and
    actors. Each test has an app (and a rendezvous store) of its own."""
    config = ClusterConfig.model_validate({
        "engine": ENGINE, "pools": [{"role": "mixed", "tensor_parallel_size": 2, "resources": TINY}],
        "scheduler": {"idle_report_interval_s": 1, "orphan_timeout_s": orphan_timeout_s}})
    _, rendezvous = asyncio.run(open_rendezvous(app, 30, 60))
    name = f"{app}-{worker_id}"
    options = {**config.pools[0].resources.ray_options(), "name": name, "namespace": WORKER_NAMESPACE,
               "lifetime": "detached", "max_restarts": 0}
    actors = asyncio.run(start_worker_actors(config.pools[0], worker_id, options, config.model_dump(), rendezvous))
    assert ray.get(actors.handle.info.remote(), timeout=120)["worker_id"] == worker_id  # renews the lease
    return name, actors


def test_a_worker_no_cls_calls_stops_with_its_other_rank_and_its_placement_group(ray_cluster):
    name, _ = _tp2_worker(APP, "mixed-0.0", orphan_timeout_s=10)
    assert [w.name for w in find_workers(APP)] == [name] and _alive(shard_name(name, 1))
    assert 8 <= _gone_within(40, name, shard_name(name, 1))
    assert {g["state"] for g in placement_group_table().values() if g["name"] == group_name(name)} == {"REMOVED"}
    ray.kill(ray.get_actor(f"{APP}-rendezvous", namespace=WORKER_NAMESPACE))


def test_the_other_rank_and_group_of_a_worker_whose_rank_0_died_are_stopped_at_adoption(ray_cluster):
    app = f"{APP}-strays"
    name, actors = _tp2_worker(app, "mixed-0.1", orphan_timeout_s=60)
    ray.kill(actors.handle)  # while no CLS runs: nothing else stops rank 1
    _gone_within(30, name)
    assert _alive(shard_name(name, 1))
    assert sorted(stop_strays(app)) == [group_name(name), shard_name(name, 1)]
    _gone_within(30, shard_name(name, 1))
    assert {g["state"] for g in placement_group_table().values() if g["name"] == group_name(name)} == {"REMOVED"}
    assert stop_strays(app) == []
    ray.kill(ray.get_actor(f"{app}-rendezvous", namespace=WORKER_NAMESPACE))
