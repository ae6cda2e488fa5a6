"""Load on a real cluster: 64 concurrent streams with none lost, a prompt backlog that moves the
token worker into the mixed pool and back (seen on the status endpoint), 429 with Retry-After
when the cluster cannot admit, interactive requests served during a background flood, the
optional API key, and served model aliases."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.ray_cluster import POOLS_KEY


def test_64_concurrent_streams_none_lost(server):
    openai = pytest.importorskip("openai")

    async def one(client, i):
        stream = await client.completions.create(model="demo", prompt=f"request {i}", max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    for chunks in results:
        assert chunks[-1].usage.completion_tokens == 12
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c[0].id for c in results}) == 64


def pools_status(url) -> dict:
    return httpx.get(f"{url}/v1/cluster/status", headers=POOLS_KEY).json()


def test_prompt_backlog_moves_the_token_worker_into_the_mixed_pool_and_back(pools_server):
    before = pools_status(pools_server)["counters"]

    async def burst():
        async with httpx.AsyncClient(timeout=300, headers=POOLS_KEY) as http:
            body = {"model": "demo", "prompt": "p" * 500, "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{pools_server}/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(burst())
    assert {r.status_code for r in responses} <= {200, 429}
    after = wait_until(lambda: pools_status(pools_server), lambda s: not s["pools"]["mixed"], timeout=30)
    counters = after["counters"]
    assert counters.get("moves_to_mixed", 0) > before.get("moves_to_mixed", 0)
    assert counters.get("moves_to_token", 0) > before.get("moves_to_token", 0)
    assert [after["workers"][w]["pool"] for w in sorted(after["workers"])] == ["prompt", "token"]


def test_overload_answers_429_with_retry_after(pools_server):
    async def flood():
        async with httpx.AsyncClient(timeout=300, headers=POOLS_KEY) as http:
            body = {"model": "demo", "prompt": "q" * 1500, "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{pools_server}/v1/completions", json=body) for _ in range(24)))

    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == len(responses)
    assert refused[0].headers["retry-after"] == "1" and "capacity" in refused[0].json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in served)


def test_interactive_requests_sent_during_a_background_flood_are_served(pools_server):
    """The pools app schedules by priority: a flood of background requests (priority 1) is partly
    refused, and interactive ones (priority 0) sent while it runs are served. (Which share of the
    queues each may fill is placement's rule, tests/placement/test_placement.py: here the queues
    drain too fast to tell it apart.)"""
    async def flood_then_ask():
        async with httpx.AsyncClient(timeout=300, headers=POOLS_KEY) as http:
            body = {"model": "demo", "prompt": "b" * 1500, "max_tokens": 32, "ignore_eos": True, "priority": 1}
            flood = [asyncio.ensure_future(http.post(f"{pools_server}/v1/completions", json=body))
                     for _ in range(16)]
            while sum(f.done() for f in flood) < 8:  # the refusals come back at once
                await asyncio.sleep(0.01)
            asked = {"model": "demo", "prompt": "i" * 300, "max_tokens": 4, "ignore_eos": True, "priority": 0}
            interactive = await asyncio.gather(*(http.post(f"{pools_server}/v1/completions", json=asked)
                                                 for _ in range(2)))
            return await asyncio.gather(*flood), interactive

    background, interactive = asyncio.run(flood_then_ask())
    assert {r.status_code for r in background} == {200, 429}
    assert [r.status_code for r in interactive] == [200, 200]


def test_api_key_is_required_when_configured(pools_server):
    assert httpx.get(f"{pools_server}/v1/models").status_code == 401
    denied = httpx.post(f"{pools_server}/v1/completions", json={"model": "demo", "prompt": "hi"},
                        headers={"Authorization": "Bearer wrong"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{pools_server}/v1/models", headers=POOLS_KEY).status_code == 200
    assert httpx.get(f"{pools_server}/health").status_code == 200  # probes need no key


def test_a_cluster_answers_to_each_of_its_served_model_names(pools_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pools_server}/v1", api_key=POOLS_KEY["Authorization"].split()[1], max_retries=0)
    assert [(m.id, m.model_extra["max_model_len"]) for m in client.models.list().data] == \
        [("demo", 2048), ("pools-alias", 2048)]
    assert (client.models.retrieve("pools-alias").id, client.models.retrieve("demo").model_extra) == \
        ("pools-alias", {"max_model_len": 2048})
    unknown = httpx.get(f"{pools_server}/v1/models/org/other", headers=POOLS_KEY)  # a hub-style name with a slash
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    texts = []
    for name in ("demo", "pools-alias"):
        got = client.completions.create(model=name, prompt="aliases", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.model == name  # the name the client sent comes back
        texts.append(got.choices[0].text)
    assert texts[0] == texts[1]
    with pytest.raises(openai.NotFoundError, match="serves `demo`, `pools-alias`"):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def wait_until(read, done, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(0.2)
    raise TimeoutError(f"condition not met in {timeout} s; last: {value}")
