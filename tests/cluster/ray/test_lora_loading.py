"""LoRA adapters loaded and unloaded while a real local cluster serves (vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`), with the official `openai` client: an
adapter loaded on the running workers answers as the offline engine does under it, on a
tensor-parallel prompt worker too; a worker started after the load (a replacement) serves it; an
unloaded one is a 404; a name loaded again with other weights answers with those; a load a
worker refuses is refused with its reason and leaves no trace; a cluster without slots says how
to get them; no ingress replica admits a request under an adapter just unloaded."""
from __future__ import annotations

import time

import httpx
import ray

from splitserve import LLM
from splitserve.engine.demo import demo_model_config
from splitserve.engine.dummy_adapter import write_adapter
from tests.cluster.ray.test_failover import status, wait_for_pools, worker_in
from tests.cluster.ray.test_lora import PROMPT, complete, offline_text
from tests.ray_cluster import ENGINE, POOLS_KEY, worker_actor


def _adapter(tmp_path, name: str, seed: int) -> str:
    return write_adapter(tmp_path / name, demo_model_config(), ["q_proj", "k_proj", "down_proj"], 8, seed, std=0.1)


def _expected(path: str, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    return offline_text(LLM("demo", lora_modules={"demo-new": path}, **ENGINE), prompt, max_tokens, "demo-new")


def _load(base: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)


def _unload(base: str, name: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def test_an_adapter_loaded_while_serving_answers_until_it_is_unloaded(server, client, tmp_path):
    first, second = _adapter(tmp_path, "first", 11), _adapter(tmp_path, "second", 12)
    loaded = _load(server, "demo-new", first)
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'demo-new' added successfully.")
    card = next(m for m in client.models.list().data if m.id == "demo-new")
    assert card.parent == "demo"
    for prompt in (PROMPT, "y" * 600):  # pushed after the prefill, and streamed by layer
        assert complete(client, "demo-new", prompt, 12).choices[0].text == _expected(first, prompt)
    again = _load(server, "demo-new", second)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    unloaded = _unload(server, "demo-new")
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'demo-new' removed successfully.")
    gone = httpx.post(f"{server}/v1/completions", json={"model": "demo-new", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert _unload(server, "demo-new").status_code == 404
    assert _load(server, "demo-new", second).status_code == 200  # the name again, other weights
    assert complete(client, "demo-new", PROMPT, 12).choices[0].text == _expected(second)
    assert _unload(server, "demo-new").status_code == 200


def test_a_load_a_worker_refuses_is_refused_with_its_reason_and_kept_by_none(server, tmp_path):
    refused = _load(server, "demo-bad", str(tmp_path / "nowhere"))
    error = refused.json()["error"]
    assert refused.status_code == 400 and "adapter_config.json: file not found" in error["message"]
    assert error["param"] == "lora_name"
    for worker_id in status(server)["workers"]:
        held = ray.get(worker_actor("main", worker_id).lora_adapters.remote(), timeout=30)
        assert set(held) == {"demo-sql", "demo-chat"}, worker_id
    malformed = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "lora_path"


def test_a_worker_started_after_the_load_serves_the_adapter(server, client, tmp_path):
    path = _adapter(tmp_path, "kept", 13)
    assert _load(server, "demo-new", path).status_code == 200
    token_worker = worker_in(server, "token")
    ray.kill(worker_actor("main", token_worker))
    deadline = time.monotonic() + 120
    while token_worker in status(server)["workers"] and time.monotonic() < deadline:
        time.sleep(0.2)
    wait_for_pools(server, {"prompt": 1, "token": 1})
    replacement = worker_in(server, "token")
    assert replacement != token_worker
    held = ray.get(worker_actor("main", replacement).lora_adapters.remote(), timeout=30)
    assert held["demo-new"][0] == path
    try:
        assert complete(client, "demo-new", PROMPT, 12).choices[0].text == _expected(path)
    finally:
        _unload(server, "demo-new")


def test_a_tensor_parallel_worker_loads_its_ranks_slices(tp_server, tmp_path):
    path = _adapter(tmp_path, "tp", 14)
    assert _load(tp_server, "demo-new", path).status_code == 200
    body = {"model": "demo-new", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{tp_server}/v1/completions", json=body, timeout=120).json()
    assert got["choices"][0]["text"] == _expected(path)
    assert _unload(tp_server, "demo-new").status_code == 200


def test_a_cluster_without_slots_says_how_to_get_them(hardening_server):
    refused = _load(hardening_server, "demo-new", "/nowhere")
    assert refused.status_code == 404 and "engine.max_loras" in refused.json()["error"]["message"]


def test_no_ingress_replica_admits_a_request_under_an_adapter_just_unloaded(pools_server, tmp_path):
    """Two replicas: the one that did not run the unload may still list the adapter (for up to a
    second), but the CLS places nothing under it."""
    path = _adapter(tmp_path, "replicas", 15)
    load = httpx.post(f"{pools_server}/v1/load_lora_adapter", json={"lora_name": "demo-new", "lora_path": path},
                      headers=POOLS_KEY, timeout=120)
    assert load.status_code == 200
    body = {"model": "demo-new", "prompt": PROMPT, "max_tokens": 2}
    with httpx.Client(base_url=pools_server, headers=POOLS_KEY, timeout=120) as http:
        assert all(http.post("/v1/completions", json=body).status_code == 200 for _ in range(6))  # both replicas
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "demo-new"}).status_code == 200
        codes = [http.post("/v1/completions", json=body).json()["error"]["code"] for _ in range(10)]
    assert codes == ["model_not_found"] * 10
