"""`/v1/embeddings` through a real local cluster, with the official `openai` client: each input's
embedding is the offline engine's (`LLM.embed`), as floats or as the base64 the client asks by
default, truncated to `dimensions`, under a LoRA adapter too; each input runs whole on the prompt
worker; a bad request is a 400 naming its field."""
from __future__ import annotations

import math

import httpx
import pytest
import ray

from tests.cluster.ray.test_hardening import metric
from tests.ray_cluster import count_reserves, worker_actor

INPUTS = ["The capital of France is", "Embeddings map text to vectors", "x" * 300]


@pytest.mark.parametrize("encoding_format", ["float", None])  # None: the client's default, base64
def test_each_input_embeds_as_the_offline_engine_does(client, offline, encoding_format):
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    got = client.embeddings.create(model="demo", input=INPUTS, **extra)
    expected = offline.embed(INPUTS)
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "demo"
    for ours, ref in zip(got.data, expected):
        assert ours.embedding == pytest.approx(ref, abs=1e-5)
    prompt_tokens = sum(len(offline.get_tokenizer().encode(text)) for text in INPUTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == prompt_tokens


def test_dimensions_and_an_adapter(client, offline):
    [short] = client.embeddings.create(model="demo", input=INPUTS[0], dimensions=8).data
    full = offline.embed(INPUTS[0])[0][:8]
    norm = math.sqrt(sum(x * x for x in full))
    assert short.embedding == pytest.approx([x / norm for x in full], abs=1e-5)
    [adapted] = client.embeddings.create(model="demo-sql", input=INPUTS[0], encoding_format="float").data
    assert adapted.embedding == pytest.approx(offline.embed(INPUTS[0], lora="demo-sql")[0], abs=1e-5)
    assert adapted.embedding != pytest.approx(offline.embed(INPUTS[0])[0], abs=1e-3)


def test_an_input_runs_whole_on_the_prompt_worker(server, client):
    """A prompt-only request: the token worker reserves no KV for it and receives none."""
    status = httpx.get(f"{server}/v1/cluster/status").json()
    token = worker_actor("main", next(w for w, s in status["workers"].items() if s["pool"] == "token"))
    ray.get(token.__ray_call__.remote(count_reserves), timeout=60)
    try:
        client.embeddings.create(model="demo", input=["a b c", "s" * 700], encoding_format="float")
        assert ray.get(token.__ray_call__.remote(lambda actor: actor.reserves), timeout=60) == 0
    finally:
        ray.get(token.__ray_call__.remote(lambda actor: delattr(actor.loop, "reserve")), timeout=60)


def test_embeddings_count_in_the_pooling_kinds_series(server, client):
    """Two inputs, two pooling requests, none of them generation's: /metrics keeps them apart."""
    def completed(kind: str) -> float:
        return metric(server, f'splitserve_requests_total{{kind="{kind}",lora="",model="demo",outcome="completed"}}')

    before = {kind: completed(kind) for kind in ("generate", "pooling")}
    client.embeddings.create(model="demo", input=["count me", "and me"], encoding_format="float")
    assert completed("pooling") == before["pooling"] + 2 and completed("generate") == before["generate"]


@pytest.mark.parametrize("body, param", [({"input": []}, "input"), ({"input": ""}, "input"),
                                         ({"input": "a", "dimensions": 10 ** 6}, "dimensions"),
                                         ({"input": "a", "model": "nope"}, "model")])
def test_a_bad_request_is_a_4xx_naming_its_field(server, body, param):
    answer = httpx.post(f"{server}/v1/embeddings", json={"model": "demo", **body})
    assert 400 <= answer.status_code < 500 and answer.json()["error"]["param"] == param
