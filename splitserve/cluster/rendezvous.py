"""The store workers meet through to open KV links and TP groups (torch pair groups, gRPC
addresses, TP sizes), and the cluster's transfer secret (workers authenticate each other's gRPC KV
servers with it). A detached actor of its own, not a part of the CLS: workers a new CLS adopts keep
their store and their secret, and the workers it starts meet them there."""
from __future__ import annotations

import datetime
import secrets

import ray
import torch.distributed as dist

from splitserve.cluster.orphan_lease import OrphanLease
from splitserve.cluster.worker_group import WORKER_NAMESPACE

Rendezvous = tuple[str, int, str]  # the store's (host, port) and the cluster's transfer secret


class RendezvousStore:
    def __init__(self, timeout_s: float, orphan_timeout_s: float):
        self._host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._secret = secrets.token_urlsafe(32)
        current = ray.get_runtime_context().current_actor
        self._lease = OrphanLease(orphan_timeout_s, lambda: ray.kill(current, no_restart=True), "rendezvous store")
        self._lease.start()

    def address(self) -> Rendezvous:
        """Where workers join the store, and the secret. Renews the lease, as every CLS call does."""
        self._lease.renew()
        return self._host, self._store.port, self._secret


async def open_rendezvous(app: str, timeout_s: float, orphan_timeout_s: float) -> tuple[object, Rendezvous]:
    """`app`'s store: the one a dead CLS left, else a new one."""
    store = ray.remote(RendezvousStore).options(
        name=f"{app}-rendezvous", namespace=WORKER_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=0).remote(timeout_s, orphan_timeout_s)
    return store, await store.address.remote()
