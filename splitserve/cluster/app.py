"""The Serve builder: `splitserve.cluster.app:build_app` for `serve run`, `serve deploy`, a KubeRay
RayService's `serveConfigV2` and `splitserve serve`. It validates its arguments and only binds:
the controller deployment and the OpenAI ingress in front of it.

The controller deployment (one replica) owns the CLS actor, which holds the one placement state
and owns the workers; Serve manages its life (a failed health check restarts it, and with it the
CLS and the workers). Ingress replicas call the CLS actor directly: a plain actor call costs a
fraction of a Serve handle call, and placement sits on every request's path.
"""
from __future__ import annotations

import ray
from ray import serve

from splitserve.cluster.batch_manager import BatchManager
from splitserve.cluster.controller import WORKER_NAMESPACE, Controller
from splitserve.cluster.ingress import Ingress
from splitserve.cluster.worker import MAX_CONCURRENT_CALLS
from splitserve.config import ClusterConfig


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, health_check_period_s=5)
class ClusterController:
    def __init__(self, config: dict):
        app = serve.get_replica_context().app_name
        self.cls = ray.remote(Controller).options(
            name=f"{app}-controller", namespace=WORKER_NAMESPACE, num_cpus=0,
            max_concurrency=MAX_CONCURRENT_CALLS).remote(config, app)
        self.cls.start.remote()
        self.batches = ray.remote(BatchManager).options(
            name=f"{app}-batches", namespace=WORKER_NAMESPACE, num_cpus=0).remote(config, self.cls)
        self.batches.start.remote()

    def handle(self):
        """The CLS actor, for the ingress to call directly."""
        return self.cls

    def batches_handle(self):
        """The batch API's actor (/v1/files, /v1/batches)."""
        return self.batches

    async def check_health(self) -> None:
        await self.cls.health.remote()  # raises if the CLS actor died: Serve restarts this replica


def build_app(args: dict) -> serve.Application:
    """`args`: a ClusterConfig as a dict (a Serve config's `args`); invalid args raise a pydantic
    ValidationError naming the field."""
    config = ClusterConfig.model_validate(args or {})
    as_dict = config.model_dump()
    ingress = Ingress.options(num_replicas=config.ingress.num_replicas,
                              ray_actor_options={"num_cpus": config.ingress.num_cpus})
    return ingress.bind(ClusterController.bind(as_dict), as_dict)
