"""No request can take a worker down, and no KV is stranded, on a real cluster (the `hardening`
app: 3 s leases and stuck bound, small request bounds, fault injection on).

References: the offline engine's greedy text, the workers' own integrity checks and block counts,
the cluster's /v1/cluster/status and /metrics, and the official `openai` client's error parsing."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from tests.cluster.ray.hardening_app import (  # noqa: F401 (fixtures)
    APP, PROMPT, actor, blocks_in_use, hclient, url, wait_until_no_blocks,
)
from tests.cluster.ray.test_failover import expected, status, wait_for_pools, worker_in
from tests.ray_cluster import worker_actor


def metric(url, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def metric_above(url, name: str, value: float, timeout_s: float = 5.0) -> float:
    """`name` once it passes `value`: a worker's counters reach /metrics with its next load report."""
    deadline = time.monotonic() + timeout_s
    while (current := metric(url, name)) <= value and time.monotonic() < deadline:
        time.sleep(0.1)
    return current


def greedy(hclient, prompt=PROMPT, max_tokens=24, **extra):
    return hclient.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})


def test_a_tiny_temperature_is_answered_greedily_and_the_cluster_keeps_serving(url, hclient, offline):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    got = hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=1e-300,
                                     extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected(offline, PROMPT, 24)
    assert greedy(hclient).choices[0].text == expected(offline, PROMPT, 24)


def test_an_exception_in_a_step_fails_over_and_the_worker_keeps_serving(url, hclient, offline):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    token_worker = worker_in(url, "token")
    before = metric(url, "splitserve_worker_step_failures_total")
    ray.get(actor(token_worker).inject_fault.remote("fail_steps", times=1))
    assert greedy(hclient, max_tokens=32).choices[0].text == expected(offline, PROMPT, 32)
    assert token_worker in status(url)["workers"]  # the same worker: not replaced
    assert greedy(hclient).choices[0].text == expected(offline, PROMPT, 24)
    assert metric(url, "splitserve_worker_step_failures_total") == before + 1
    wait_until_no_blocks(url)


def test_a_failure_that_breaks_the_engine_state_gets_the_worker_replaced(url, hclient, offline):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    token_worker = worker_in(url, "token")
    ray.get(actor(token_worker).inject_fault.remote("fail_steps", times=1, leak_block=True))
    assert greedy(hclient, max_tokens=16).choices[0].text == expected(offline, PROMPT, 16)
    state = wait_for_pools(url, {"prompt": 1, "token": 1})
    assert token_worker not in state["workers"]
    wait_until_no_blocks(url)


def test_a_stuck_step_is_reported_and_the_worker_replaced(url, hclient, offline):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    token_worker = worker_in(url, "token")
    failures = status(url)["counters"].get("worker_failures", 0)
    ray.get(actor(token_worker).inject_fault.remote("stall_step", seconds=60))
    assert greedy(hclient, max_tokens=16).choices[0].text == expected(offline, PROMPT, 16)
    state = wait_for_pools(url, {"prompt": 1, "token": 1})
    assert token_worker not in state["workers"] and state["counters"]["worker_failures"] == failures + 1
    wait_until_no_blocks(url)


def test_a_prompt_worker_frozen_mid_transfer_lets_the_lease_free_the_blocks_on_both_sides(url, hclient):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    prompt_worker, token_worker = worker_in(url, "prompt"), worker_in(url, "token")
    pid = ray.get(actor(prompt_worker).info.remote())["pid"]
    ray.get(actor(prompt_worker).inject_fault.remote("freeze_after_layer_pushes", n=2))  # 2 of 4 layers leave
    expired = metric(url, "splitserve_kv_leases_expired_total")
    with httpx.Client(timeout=120) as http:
        pending = http.build_request("POST", f"{url}/v1/completions", json={
            "model": "demo", "prompt": "q" * 600, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        response = http.send(pending, stream=True)
        try:
            deadline = time.monotonic() + 8  # the token side's 3 s lease ends; the prompt worker stays frozen
            while blocks_in_use(token_worker) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert blocks_in_use(token_worker) == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        response.read()
    assert response.status_code in (200, 503)  # completed on failover, or a clear error
    wait_until_no_blocks(url)
    assert metric(url, "splitserve_kv_leases_expired_total") >= expired + 1


def test_a_client_that_disconnects_mid_stream_stops_its_request_and_no_other(url):
    """The request stops on the workers and leaves no block in use, and another request streaming
    from the same token worker goes on undisturbed, even where the one that went away opened that
    worker's token feed (a fresh worker): Serve cancels a cancelled request's child calls, which
    neither the shared feed nor the aborts may be."""
    wait_for_pools(url, {"prompt": 1, "token": 1})
    retired = worker_in(url, "token")
    assert httpx.post(f"{url}/v1/cluster/workers/{retired}/drain", timeout=60).status_code == 200
    assert retired not in wait_for_pools(url, {"prompt": 1, "token": 1})["workers"]  # a fresh token worker
    aborted, restarted = (metric(url, name) for name in AFTER_A_DISCONNECT)
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions",
                                                           json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            for _ in range(4):
                next(lines)
            other = pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "max_tokens": 300}, timeout=120)
            time.sleep(0.5)  # it streams from the same token worker when the first client goes away, here
        assert other.result().status_code == 200 and other.result().json()["usage"]["completion_tokens"] == 300
    wait_until_no_blocks(url)
    assert metric_above(url, AFTER_A_DISCONNECT[0], aborted) > aborted
    assert metric(url, AFTER_A_DISCONNECT[1]) == restarted  # nothing failed over


AFTER_A_DISCONNECT = ("splitserve_worker_aborted_requests_total", "splitserve_requests_restarted_total")


def test_a_drained_worker_finishes_its_stream_then_leaves(url, hclient, offline):
    wait_for_pools(url, {"prompt": 1, "token": 1})
    token_worker = worker_in(url, "token")
    stream = hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    text, drained = "", None
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 3:
            drained = httpx.post(f"{url}/v1/cluster/workers/{token_worker}/drain", timeout=60)
    assert text == expected(offline, PROMPT, 200)
    assert drained.status_code == 200 and drained.json() == {"worker_id": token_worker, "unfinished": 0}
    state = wait_for_pools(url, {"prompt": 1, "token": 1})
    assert token_worker not in state["workers"] and state["counters"]["workers_retired"] >= 1
    assert httpx.post(f"{url}/v1/cluster/workers/nobody/drain").status_code == 404


def test_fault_injection_is_refused_where_the_config_does_not_enable_it(pools_server):
    worker_id = next(iter(httpx.get(f"{pools_server}/v1/cluster/status",
                                    headers={"Authorization": "Bearer sk-pools"}).json()["workers"]))
    with pytest.raises(ray.exceptions.RayTaskError, match="fault injection is disabled"):
        ray.get(worker_actor("pools", worker_id).inject_fault.remote("fail_steps", times=1))


def test_deleting_the_app_lets_a_running_stream_finish(url, hclient, offline):
    """Shutdown drain: Serve deletes the app while a stream runs; the controller keeps the workers
    until it has finished (scheduler.drain_timeout_s), so the client gets every token and [DONE].
    Then no actor of the app is left holding its CPUs. The app is deployed again afterwards for
    the tests that follow."""
    from ray import serve
    from ray.util.state import list_actors

    from tests.ray_cluster import HARDENING, _deploy

    wait_for_pools(url, {"prompt": 1, "token": 1})
    stream = hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    text, deleting = "", None
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 3:
            deleting = threading.Thread(target=serve.delete, args=(APP,))
            deleting.start()
    assert text == expected(offline, PROMPT, 300)
    deleting.join(120)
    assert not deleting.is_alive()

    def left() -> list[str]:  # workers, controller and batch actor are named after the app
        return [a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if (a.name or "").startswith(f"{APP}-")]
    deadline = time.monotonic() + 30  # the owner's exit reaches the GCS's actor table a moment later
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    assert not left()
    _deploy(url.rsplit("/", 1)[0], APP, HARDENING)


# ---- bounds: each a 4xx with OpenAI's error body -----------------------------------------------
def _refused(response: httpx.Response, status_code: int, param: str | None) -> None:
    assert response.status_code == status_code, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("body, status_code, param", [
    ({"prompt": "x" * 20_001}, 413, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "stop": "y" * 33}, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": list(range(9))}, 400, "stop_token_ids"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
    ({"prompt": ["x" * 10_001, "y" * 10_000]}, 413, "prompt"),
])
def test_completion_bounds(url, body, status_code, param):
    _refused(httpx.post(f"{url}/v1/completions", json={"model": "demo", **body}, timeout=30), status_code, param)


def test_chat_bounds(url):
    messages = [{"role": "user", "content": "hi"}] * 9
    _refused(httpx.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": messages}), 400, "messages")
    long = [{"role": "user", "content": "x" * 20_001}]
    _refused(httpx.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": long}), 413, "messages")


def test_a_body_over_the_size_bound_is_413_declared_or_streamed(url):
    big = json.dumps({"model": "demo", "prompt": "x", "user": "u" * 70_000}).encode()
    _refused(httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}),
             413, None)
    chunked = httpx.post(f"{url}/v1/completions", content=iter([big[:40_000], big[40_000:]]),
                         headers={"content-type": "application/json"})
    _refused(chunked, 413, None)


def test_an_upload_over_its_bound_is_413(url):
    _refused(httpx.post(f"{url}/v1/files", files={"file": ("big.jsonl", b"x" * 70_000)}, data={"purpose": "batch"}),
             413, None)


def test_a_wrong_or_missing_key_is_refused_on_every_route(pools_server):
    """Every route the ingress serves (its OpenAPI document lists them, the batch API's included)
    but the open /health and /metrics; the document itself needs the key too."""
    from splitserve.api.guard import OPEN_PATHS

    assert httpx.get(f"{pools_server}/openapi.json").status_code == 401
    spec = httpx.get(f"{pools_server}/openapi.json", headers={"Authorization": "Bearer sk-pools"}).json()
    routes = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    assert len(routes) >= 15 and ("POST", "/v1/cluster/workers/{worker_id}/drain") in routes
    for method, path in routes:
        concrete = path.replace("{", "").replace("}", "")  # e.g. /v1/files/file_id
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-pools"}):
            response = httpx.request(method, f"{pools_server}{concrete}", headers=headers, timeout=30)
            if path in OPEN_PATHS:
                assert response.status_code != 401
            else:
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
