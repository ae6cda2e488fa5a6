"""Starting one worker's Ray actors. A worker of TP size N is N actors, one per rank, in a
placement group of N bundles (each the pool's `resources`) packed on one node (STRICT_PACK):
rank 0 is the `Worker`, the others `ShardWorker`s. They meet through the rendezvous store. All
are detached (named as `worker_group` says): they outlive the CLS that starts them."""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.cluster.shard_worker import ShardWorker
from splitserve.cluster.worker import Worker
from splitserve.cluster.worker_group import WorkerActors, group_name, shard_name
from splitserve.config import PoolConfig


def bundle(pool: PoolConfig) -> dict[str, float]:
    """One rank's reservation as a placement-group bundle."""
    r = pool.resources
    found = {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.resources}
    if r.accelerator_type:
        found[f"accelerator_type:{r.accelerator_type}"] = 0.001  # Ray's own label resource
    return {name: amount for name, amount in found.items() if amount > 0}


async def start_worker_actors(pool: PoolConfig, worker_id: str, options: dict, config: dict,
                              rendezvous) -> WorkerActors:
    """The worker's actors, once placed (their constructors then load the model). `options`
    name rank 0 and make it detached; its other ranks and their group are named after it."""
    size = pool.tensor_parallel_size
    if size == 1:
        return WorkerActors(ray.remote(Worker).options(**options).remote(
            worker_id, pool.role, pool.hardware, config, rendezvous))
    group = placement_group([bundle(pool)] * size, strategy="STRICT_PACK", name=group_name(options["name"]),
                            lifetime="detached")
    await group.ready()

    def placed(rank: int, actor_options: dict) -> dict:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        return {**actor_options, "scheduling_strategy": strategy}

    handle = ray.remote(Worker).options(**placed(0, options)).remote(
        worker_id, pool.role, pool.hardware, config, rendezvous, size)
    shard_options = {k: v for k, v in options.items() if k not in ("name", "max_concurrency")}
    shards = [ray.remote(ShardWorker).options(**placed(rank, {**shard_options,
                                                              "name": shard_name(options["name"], rank)}))
              .remote(worker_id, rank, size, pool.role, config, rendezvous) for rank in range(1, size)]
    return WorkerActors(handle, shards, group)
