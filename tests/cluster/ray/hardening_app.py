"""What the tests of the `hardening` app share: its name, a prompt, the server's URL and an
`openai` client as fixtures, and the KV blocks its workers hold."""
from __future__ import annotations

import time

import openai
import pytest
import ray

from tests.cluster.ray.test_failover import status
from tests.ray_cluster import worker_actor

APP = "hardening"
PROMPT = "Hardening keeps the cluster serving"


@pytest.fixture(scope="module")
def url(hardening_server):
    return hardening_server


@pytest.fixture(scope="module")
def hclient(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def actor(worker_id: str):
    return worker_actor(APP, worker_id)


def blocks_in_use(worker_id: str) -> int:
    return ray.get(actor(worker_id).check_integrity.remote(), timeout=30)["blocks_used"]


def wait_until_no_blocks(url, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        used = {w: blocks_in_use(w) for w in status(url)["workers"]}
        if not any(used.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still in use: {used}")
        time.sleep(0.2)
