"""The Serve builder: `splitserve.cluster.app:build_app` for `serve run`, `serve deploy`, a KubeRay
RayService's `serveConfigV2` and `splitserve serve`. It validates its arguments and only binds:
the controller deployment and the OpenAI ingress in front of it.

The controller deployment (one replica) owns the CLS actor, which holds the one placement state
and starts the workers (detached: they outlive it, and the next CLS adopts them). Ray restarts a
CLS that crashed, in place; Serve manages the replica's life (a health check that finds the CLS
gone for good replaces it, and with it the CLS). It owns the batch API's actor too, which runs on
the head node: `batch.dir` is a directory there (on Kubernetes, the head pod's batches volume),
wherever the replica runs; and the store of /v1/responses answers, on the head node too (its
files in `batch.dir`/responses).
Ingress replicas call the CLS actor directly: a plain actor call costs a fraction of a Serve
handle call, and placement sits on every request's path. They ask this deployment for its actors
again once they find one dead (`owned_actor.py`), so a replaced controller is found.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ray
from ray import serve
from ray.exceptions import RayError

from splitserve.cluster.batch_manager import BatchManager
from splitserve.cluster.controller import WORKER_NAMESPACE, Controller
from splitserve.cluster.frozen_heap import frozen_heap
from splitserve.cluster.ingress import Ingress
from splitserve.cluster.owned_actor import through_restart
from splitserve.cluster.persisted_responses import PersistedResponseStore
from splitserve.cluster.worker import MAX_CONCURRENT_CALLS
from splitserve.config import ClusterConfig

log = logging.getLogger(__name__)
TEND_TIMEOUT_S = 2.0  # well inside Serve's health-check timeout
HEAD_NODE = "node:__internal_head__"  # a resource only Ray's head node has (Ray pins its own state actors with it)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, health_check_period_s=5)
class ClusterController:
    def __init__(self, config: dict):
        app = serve.get_replica_context().app_name
        # a crash: Ray restarts it in place, and it adopts the workers
        self.cls = ray.remote(frozen_heap(Controller)).options(
            name=f"{app}-controller", namespace=WORKER_NAMESPACE, num_cpus=0, max_restarts=-1,
            max_concurrency=MAX_CONCURRENT_CALLS).remote(config, app, True)
        self.cls.start.remote()
        self.batches = ray.remote(frozen_heap(BatchManager)).options(  # a restart resumes its active batches (`_tend`)
            name=f"{app}-batches", namespace=WORKER_NAMESPACE, num_cpus=0,
            resources={HEAD_NODE: 0.001}, max_restarts=-1).remote(config, self.cls)
        self.batches.start.remote()
        cluster = ClusterConfig.model_validate(config)
        files = Path(cluster.batch.dir) / "responses" if cluster.ingress.persist_stored_responses else None
        ingress = cluster.ingress
        self.responses = ray.remote(frozen_heap(PersistedResponseStore)).options(  # a restart reads its files again
            name=f"{app}-responses", namespace=WORKER_NAMESPACE, num_cpus=0, resources={HEAD_NODE: 0.001},
            max_restarts=-1).remote(ingress.stored_responses, ingress.stored_response_bytes, files,
                                    max_conversations=ingress.stored_conversations,
                                    max_conversation_bytes=ingress.stored_conversation_bytes)

    def handle(self):
        """The CLS actor, for the ingress to call directly."""
        return self.cls

    def batches_handle(self):
        """The batch API's actor (/v1/files, /v1/batches)."""
        return self.batches

    def responses_handle(self):
        """The store of /v1/responses answers and /v1/conversations."""
        return self.responses

    async def check_health(self) -> None:
        """Fails (Serve replaces this replica) only when the CLS is gone for good, not while Ray
        restarts it: that would drain the workers the restarted CLS adopts."""
        await through_restart(self.cls.health)
        await self._tend()

    async def _tend(self) -> None:
        """The batch actor and the response store outlive a crash of theirs (Ray restarts them,
        not this replica): a restarted batch actor is started again, which resumes its active
        batches, and a store that found its directory owned takes it over once it can. Both calls
        are idempotent and cheap; neither fails this health check."""
        for name, call in (("batch API's actor", self.batches.start), ("response store", self.responses.take_over)):
            try:
                await asyncio.wait_for(call.remote(), TEND_TIMEOUT_S)
            except (RayError, asyncio.TimeoutError) as error:  # restarting: the next check tries again
                log.warning("the %s did not answer the controller's health check: %r", name, error)

    async def __del__(self) -> None:
        """Serve calls this when the app is deleted or the replica replaced: the workers finish
        what they run (bounded by scheduler.drain_timeout_s) before they stop with this replica."""
        await self.cls.drain.remote()


def build_app(args: dict) -> serve.Application:
    """`args`: a ClusterConfig as a dict (a Serve config's `args`); invalid args raise a pydantic
    ValidationError naming the field."""
    config = ClusterConfig.model_validate(args or {})
    as_dict = config.model_dump()
    grace = config.scheduler.drain_timeout_s + 10  # Serve stops a replica this long after asking it to
    ingress = Ingress.options(num_replicas=config.ingress.num_replicas, graceful_shutdown_timeout_s=grace,
                              ray_actor_options={"num_cpus": config.ingress.num_cpus})
    return ingress.bind(ClusterController.options(graceful_shutdown_timeout_s=grace).bind(as_dict), as_dict)
