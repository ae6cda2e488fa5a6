"""One local Ray cluster for the whole test run (sized for 2 cores), with two splitserve apps:
`main` at / (1 prompt + 1 token worker, like deploy/local-cpu.yaml) and `pools` at /pools (the
same shape with low thresholds, an API key and two ingress replicas sharing one CLS, for pool
moves, backpressure and auth)."""
from __future__ import annotations

import socket

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from splitserve.cluster.app import build_app  # noqa: E402
from splitserve.cluster.controller import WORKER_NAMESPACE  # noqa: E402
from splitserve.cluster.launcher import wait_until_healthy  # noqa: E402

ENGINE = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 2048}
MAIN = {"engine": ENGINE, "transfer": {"backend": "gloo", "timeout_s": 10},
        "scheduler": {"report_interval_s": 0.05}}
POOLS = {"engine": ENGINE, "transfer": {"backend": "gloo", "timeout_s": 10},
         "scheduler": {"report_interval_s": 0.05, "mixed_prompt_tokens": 600, "max_queue_tokens": 3000,
                       "max_decode_queue_tokens": 3000},
         "ingress": {"api_key": "sk-pools", "num_replicas": 2}}
POOLS_KEY = {"Authorization": "Bearer sk-pools"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def server(ray_cluster):
    """Base URL of the main app, ready to serve."""
    serve.run(build_app(MAIN), name="main", route_prefix="/", blocking=False)
    wait_until_healthy(ray_cluster, timeout=180)
    return ray_cluster


@pytest.fixture(scope="session")
def pools_server(ray_cluster, server):
    serve.run(build_app(POOLS), name="pools", route_prefix="/pools", blocking=False)
    url = f"{ray_cluster}/pools"
    wait_until_healthy(url, timeout=180)
    return url


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def offline():
    """The offline engine the cluster's greedy output must equal."""
    from splitserve import LLM

    return LLM("demo", **ENGINE)


def worker_actor(app: str, worker_id: str):
    return ray.get_actor(f"{app}-{worker_id}", namespace=WORKER_NAMESPACE)
