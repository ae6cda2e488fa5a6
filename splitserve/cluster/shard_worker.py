"""A tensor-parallel worker's rank > 0, as a Ray actor: its shard of the model and of the KV cache,
stepping on a thread of its own as rank 0 (the `Worker` actor) says, with a KV transport of its
own where the cluster exchanges KV. The controller places it in its worker's placement group and
kills it with its worker (or rank 0 does, orphaned)."""
from __future__ import annotations

import logging
import threading

import torch.distributed as dist

from splitserve.cluster.rendezvous import Rendezvous
from splitserve.cluster.worker import connect_transport, join_store, tp_prefix
from splitserve.config import ClusterConfig
from splitserve.engine.model_builder import resolve_device
from splitserve.engine.tensor_parallel import TPGroup
from splitserve.engine.tp_step import TPFollower
from splitserve.transfer.follower_kv import FollowerKV
from splitserve.transfer.kv_routes import rank_peer

log = logging.getLogger("splitserve.worker")


class ShardWorker:
    def __init__(self, worker_id: str, rank: int, size: int, role: str, config: dict, rendezvous: Rendezvous):
        cfg = ClusterConfig.model_validate(config)
        engine_config = cfg.engine_config(role)
        store = join_store(rendezvous, cfg.transfer.timeout_s)
        group = TPGroup(dist.PrefixStore(tp_prefix(worker_id), store), rank, size,
                        resolve_device(engine_config.device), cfg.transfer.timeout_s)
        self.follower = TPFollower(cfg.model, engine_config, group)
        if cfg.disaggregated:
            FollowerKV(self.follower, connect_transport(cfg, rank_peer(worker_id, rank), self.follower, rendezvous))
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"tp-rank-{rank}")
        self._thread.start()

    def health(self) -> dict:
        return {"alive": self._thread.is_alive(), "error": self.error}

    def _serve(self) -> None:
        try:
            self.follower.serve()
        except Exception as error:  # the leader's next round fails too, and the worker is replaced
            self.error = f"{type(error).__name__}: {error}"
            log.exception("tensor-parallel rank %d left its loop", self.follower.group.rank)
