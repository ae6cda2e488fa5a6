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
import openai
import pytest
import ray

from tests.cluster.ray.test_failover import expected, status, wait_for_pools, worker_in
from tests.cluster.ray.test_batches import submit
from tests.cluster.ray.test_responses import polled
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


def test_a_dead_controller_is_replaced_and_the_new_one_adopts_the_workers_with_what_they_run(url, hclient, offline):
    """The CLS actor killed: Serve replaces the controller replica (its health check goes through
    the CLS), which makes a new CLS, a new batch actor and a new response store. The workers are
    detached: they outlive the dead CLS and the new one adopts them, so a stream and a background
    response running meanwhile complete with their greedy text, the same workers serve after, and
    no KV block is left. The ingress replica survives with the dead handles: idle meanwhile, its
    first request is placed through the new CLS, not refused, and a response kept before is read
    back from disk; busy meanwhile, /health is a 503 (never a 500) until the new CLS answers (ready at
    once: its workers are adopted, not started), every route answers after, and a request meanwhile
    is a 200 or a 503, never a 429 or a 500."""
    workers = set(wait_for_pools(url, {"prompt": 1, "token": 1})["workers"])
    kept = hclient.responses.create(model="demo", input=PROMPT, max_output_tokens=6, temperature=0)
    time.sleep(1.5)  # its observation sent: the ingress calls nothing while the controller is replaced
    replace_the_controller()
    assert hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == \
        expected(offline, PROMPT, 8)
    assert hclient.responses.retrieve(kept.id) == kept
    assert set(status(url)["workers"]) == workers and status(url)["counters"]["workers_adopted"] == 2

    ask = dict(model="demo", input=PROMPT, max_output_tokens=400, temperature=0)
    running = hclient.responses.create(**ask, background=True)
    stream = hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    text = "".join(next(stream).choices[0].text for _ in range(3))
    assert hclient.responses.retrieve(running.id).status == "in_progress"
    replace_the_controller(wait=False)
    answers, refusals, deadline = [], [], time.monotonic() + 120
    while True:
        refusals.append(httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 2},
                                   timeout=60).status_code)
        if (health := httpx.get(f"{url}/health", timeout=60)).status_code == 200:
            break
        answers.append(health.status_code)
        assert time.monotonic() < deadline, answers
        time.sleep(0.5)
    assert set(answers) <= {503} and set(refusals) <= {200, 503}, (answers, refusals)
    assert text + "".join(chunk.choices[0].text for chunk in stream) == expected(offline, PROMPT, 300)
    assert "splitserve_requests" in httpx.get(f"{url}/metrics", timeout=30).text
    assert httpx.get(f"{url}/v1/batches", timeout=30).json()["object"] == "list"
    ended, foreground = polled(hclient, running.id, timeout_s=90), hclient.responses.create(**ask)
    assert ended.status == foreground.status and ended.output_text == foreground.output_text, ended
    assert set(status(url)["workers"]) == workers
    wait_until_no_blocks(url, timeout=30)


def test_a_crashed_cls_is_restarted_in_place_and_serves_at_once_with_the_workers_it_adopts(url, hclient, offline):
    """The CLS's process SIGKILLed (a crash; not ray.kill, which forbids a restart): Ray restarts the
    actor in place, so every handle to it stays good and the controller replica (with its batch
    actor and response store) is not replaced. The restarted CLS adopts the workers: a stream
    running meanwhile completes with its greedy text, and requests sent right after the crash are
    all served, none refused."""
    from ray.util.state import list_actors

    def alive(**filters):
        return list_actors(filters=[*((k, "=", v) for k, v in filters.items()), ("state", "=", "ALIVE")])

    workers = set(wait_for_pools(url, {"prompt": 1, "token": 1})["workers"])
    [cls] = alive(name=f"{APP}-controller")
    [replica] = alive(class_name=f"ServeReplica:{APP}:ClusterController")
    stream = hclient.completions.create(model="demo", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    text = "".join(next(stream).choices[0].text for _ in range(3))
    os.kill(cls.pid, signal.SIGKILL)
    statuses = [httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 2},
                           timeout=60).status_code for _ in range(5)]
    assert statuses == [200] * 5
    assert text + "".join(chunk.choices[0].text for chunk in stream) == expected(offline, PROMPT, 300)
    [restarted] = alive(name=f"{APP}-controller")
    assert restarted.actor_id == cls.actor_id and restarted.pid != cls.pid
    assert alive(class_name=f"ServeReplica:{APP}:ClusterController") == [replica]
    assert set(status(url)["workers"]) == workers and status(url)["counters"]["workers_adopted"] == 2
    wait_until_no_blocks(url, timeout=30)


def test_a_dead_batch_actor_or_response_store_is_restarted_and_loses_nothing(url, hclient):
    """Each crashes alone (killed, Ray's restart allowed), not the controller: the store comes back
    with every response it kept; the batch actor comes back started by the controller's next health
    check and finishes the batch it was running, every line answered once, in full."""
    kept = hclient.responses.create(model="demo", input=PROMPT, max_output_tokens=6, temperature=0)
    ray.kill(ray.get_actor(f"{APP}-responses", namespace="splitserve"), no_restart=False)
    assert hclient.responses.retrieve(kept.id) == kept
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "demo", "prompt": f"{PROMPT} {i}", "max_tokens": 1200, "ignore_eos": True}}
             for i in range(4)]
    batch = submit(hclient, lines, "/v1/completions")
    while hclient.batches.retrieve(batch.id).status != "in_progress":
        time.sleep(0.2)
    time.sleep(1)  # its first lines decode
    ray.kill(ray.get_actor(f"{APP}-batches", namespace="splitserve"), no_restart=False)
    deadline = time.monotonic() + 180
    while True:
        assert time.monotonic() < deadline, "the batch never ended"
        try:
            batch = hclient.batches.retrieve(batch.id)
        except openai.APIStatusError as error:  # the actor restarting
            assert error.status_code == 503, error
            continue
        if batch.status not in ("validating", "in_progress", "finalizing"):
            break
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    # JSONL lines end at "\n" only: the demo's noise may hold U+0085 or U+2028, which str.splitlines splits at
    output = hclient.files.content(batch.output_file_id).text
    results = [json.loads(line) for line in output.split("\n") if line]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1", "r2", "r3"]
    assert {r["response"]["body"]["usage"]["completion_tokens"] for r in results} == {1200}


def test_a_background_response_whose_ingress_replica_died_is_run_again_by_the_next(url, hclient):
    """The ingress replica that admitted it is killed while it runs: Serve starts another, which,
    once a client polls through it, adopts the response when its lease lapses (LEASE_S) and runs it
    again from the start. It completes with the greedy answer and joins its conversation; the dead
    replica's run leaves no KV block behind."""
    from ray.util.state import list_actors

    wait_for_pools(url, {"prompt": 1, "token": 1})
    conversation = hclient.conversations.create()
    ask = dict(model="demo", input=PROMPT, max_output_tokens=300, temperature=0)
    running = hclient.responses.create(**ask, background=True, conversation=conversation.id)
    time.sleep(1)  # it decodes
    [replica] = list_actors(filters=[("class_name", "=", f"ServeReplica:{APP}:Ingress"), ("state", "=", "ALIVE")])
    ray.kill(ray.get_actor(replica.name, namespace="serve"))
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the background response never ended"
        try:
            ended = hclient.responses.retrieve(running.id)
        except (openai.APIConnectionError, openai.InternalServerError):  # no replica yet
            ended = None
        if ended is not None and ended.status != "in_progress":
            break
        time.sleep(0.5)
    foreground = hclient.responses.create(**ask)
    assert ended.status == foreground.status and ended.output_text == foreground.output_text, ended
    items = hclient.conversations.items.list(conversation.id, order="asc").data
    assert [item.content[0].text for item in items] == [PROMPT, foreground.output_text]
    wait_until_no_blocks(url, timeout=30)


def replace_the_controller(wait: bool = True, timeout_s: float = 120) -> None:
    """Kill the app's CLS actor, until it is dead; with `wait`, until a new one is ready, asked of Ray
    (not of the ingress)."""
    dead = ray.get_actor(f"{APP}-controller", namespace="splitserve")
    ray.kill(dead)
    with pytest.raises(ray.exceptions.RayActorError):
        while True:  # ray.kill returns before the actor is gone
            ray.get(dead.health.remote(), timeout=30)
    deadline = time.monotonic() + timeout_s
    while wait:
        assert time.monotonic() < deadline, "no new CLS"
        try:
            cls = ray.get_actor(f"{APP}-controller", namespace="splitserve")
            if cls._actor_id != dead._actor_id and ray.get(cls.health.remote(), timeout=30)["ready"]:
                return
        except (ValueError, ray.exceptions.RayError):  # not there yet, or not started yet
            pass
        time.sleep(0.5)


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
