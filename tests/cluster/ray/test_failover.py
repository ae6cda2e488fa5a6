"""Failover on a real cluster: a worker killed mid-stream or mid-prefill, and the stream still
completes with the tokens an undisturbed run gives (seeded sampling with penalties: a retried
prefill draws as the first did, a resumed attempt continues the seed stream and counts the earlier
output); the dead worker is replaced; no KV leaks."""
from __future__ import annotations

import time

import httpx
import ray

from splitserve import SamplingParams
from tests.ray_cluster import worker_actor

PROMPT = "Failover keeps the stream going"


def status(server) -> dict:
    return httpx.get(f"{server}/v1/cluster/status").json()


def worker_in(server, pool: str) -> str:
    return next(w for w, s in status(server)["workers"].items() if s["pool"] == pool)


def wait_for_pools(server, shape: dict, timeout: float = 120) -> dict:
    """Wait until the pools have `shape` (role -> count), e.g. after a replacement came up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = status(server)
        if {role: len(ids) for role, ids in state["pools"].items() if ids} == shape:
            return state
        time.sleep(0.2)
    raise TimeoutError(f"pools never became {shape}: {status(server)['pools']}")


def expected(offline, prompt, max_tokens, temperature=0.0, **sampling) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, **sampling)
    return offline.generate([prompt], params)[0].text


def check_no_leaks(server) -> None:
    """Every worker's invariants hold and, with nothing running, no KV block is in use."""
    for worker_id in status(server)["workers"]:
        held = ray.get(worker_actor("main", worker_id).check_integrity.remote(), timeout=30)
        assert held == {"blocks_used": 0, "requests": 0}, (worker_id, held)


def test_token_worker_killed_mid_stream(server, client, offline):
    wait_for_pools(server, {"prompt": 1, "token": 1})
    token_worker = worker_in(server, "token")
    sampling = dict(temperature=1.0, seed=17, frequency_penalty=0.5)
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=120, stream=True,
                                       extra_body={"ignore_eos": True}, **sampling)
    text, killed = "", False
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 5:
            ray.kill(worker_actor("main", token_worker))
            killed = True
    assert killed and text == expected(offline, PROMPT, 120, **sampling)
    state = wait_for_pools(server, {"prompt": 1, "token": 1})
    assert token_worker not in state["workers"] and state["counters"]["worker_replacements"] >= 1
    check_no_leaks(server)


def test_prompt_worker_killed_mid_prefill(server, client, offline):
    wait_for_pools(server, {"prompt": 1, "token": 1})
    prompt_worker = worker_in(server, "prompt")
    ray.get(worker_actor("main", prompt_worker).inject_fault.remote("crash_after_layer_pushes", n=2))  # 2 of the 4 layers leave
    # layer-wise streaming (>= 512 tokens); a prompt no other test sends, or the token worker could hold
    # its prefix and ask for fewer tokens than the layer-wise threshold
    prompt = "w" * 600
    sampling = dict(temperature=0.8, seed=23, presence_penalty=0.4)  # the retry redraws the first token alike
    got = client.completions.create(model="demo", prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True},
                                    **sampling)
    assert got.choices[0].text == expected(offline, prompt, 16, **sampling)
    state = wait_for_pools(server, {"prompt": 1, "token": 1})
    assert prompt_worker not in state["workers"]
    check_no_leaks(server)
