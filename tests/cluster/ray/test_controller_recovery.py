"""A dead or crashed CLS, batch actor, response store or ingress replica on a real cluster (the
`hardening` app): the workers outlive the CLS and its successor adopts them, so running streams
and background responses complete with their greedy text and nothing kept is lost.

References: the offline engine's greedy text, the workers' block counts, the cluster's
/v1/cluster/status, Ray's actor table, and the official `openai` client."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
import ray

from tests.cluster.ray.hardening_app import APP, PROMPT, hclient, url, wait_until_no_blocks  # noqa: F401 (fixtures)
from tests.cluster.ray.test_batches import submit
from tests.cluster.ray.test_failover import expected, status, wait_for_pools
from tests.cluster.ray.test_responses import polled


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
