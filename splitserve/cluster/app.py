"""The Serve builder: `splitserve.cluster.app:build_app` for `serve run`, `serve deploy`, a KubeRay
RayService's `serveConfigV2` and `splitserve serve`. It validates its arguments and only binds:
the controller (one replica: the one placement state) and the OpenAI ingress in front of it."""
from __future__ import annotations

from ray import serve

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.controller import Controller
from splitserve.cluster.ingress import Ingress



@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
class ClusterController(Controller):
    async def __init__(self, config: dict):  # Serve awaits async constructors on the replica's event loop
        super().__init__(config, serve.get_replica_context().app_name)
        self.start()


def build_app(args: dict) -> serve.Application:
    """`args`: a ClusterConfig as a dict (a Serve config's `args`); invalid args raise a pydantic
    ValidationError naming the field."""
    config = ClusterConfig.model_validate(args or {})
    as_dict = config.model_dump()
    ingress = Ingress.options(num_replicas=config.ingress.num_replicas,
                              ray_actor_options={"num_cpus": config.ingress.num_cpus})
    return ingress.bind(ClusterController.bind(as_dict), as_dict)
