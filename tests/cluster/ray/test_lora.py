"""LoRA adapters through a real local cluster, with the official `openai` client: each adapter a
model of its own (`/v1/models`, its `parent` the base), a request naming one prefilled on the prompt
worker and decoded on the token worker under it (short prompts pushed, long ones streamed layer by
layer), its greedy text the offline engine's under that adapter; the base model's and the
adapters' requests interleaved and batched together, each still its own; a cached prompt under one
never answers for another; the workers report what their one adapter slot holds to the CLS."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from splitserve.engine.sampling_params import SamplingParams

PROMPT = "Write a query that lists every order:"
MODELS = ("demo", "demo-sql", "demo-chat")


def offline_text(offline, prompt: str, max_tokens: int, model: str) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            lora=None if model == "demo" else model)
    return offline.generate([prompt], params)[0].text


def complete(client, model: str, prompt: str, max_tokens: int):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


@pytest.mark.parametrize("prompt", [PROMPT, "y" * 600])  # pushed after the prefill, and streamed by layer
def test_each_adapter_answers_as_the_offline_engine_does_under_it(client, offline, prompt):
    texts = {}
    for model in (*MODELS, "demo"):  # the base again after the adapters cached the same prompt
        got = complete(client, model, prompt, 12).choices[0]
        assert got.text == offline_text(offline, prompt, 12, model), model
        assert got.finish_reason == "length"
        texts.setdefault(model, got.text)
    assert len(set(texts.values())) == 3  # the adapters change what the model says


def test_adapters_and_the_base_batched_together_stay_apart(client, offline):
    prompts = [f"{PROMPT} #{i}" for i in range(6)]
    jobs = [(MODELS[i % 3], p) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: complete(client, job[0], job[1], 16).choices[0].text, jobs))
    assert got == [offline_text(offline, p, 16, m) for m, p in jobs]


def test_a_chat_streamed_under_an_adapter_and_its_model_card(server, client, offline):
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=10, temperature=0)
    assert whole.model == "demo-chat"
    streamed = client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    base = client.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0)
    assert base.choices[0].message.content != whole.choices[0].message.content
    card = httpx.get(f"{server}/v1/models/demo-sql").json()
    assert (card["id"], card["parent"]) == ("demo-sql", "demo")
    unknown = httpx.post(f"{server}/v1/completions", json={"model": "demo-sq", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_the_workers_report_the_adapter_their_slot_holds(server, client):
    """The main app's workers have one slot (max_cpu_loras past it): after a request under an
    adapter, both report holding it, which LoRA-aware placement reads."""
    for model in ("demo-chat", "demo-sql"):
        complete(client, model, PROMPT, 4)
        deadline, held = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            workers = httpx.get(f"{server}/v1/cluster/status").json()["workers"].values()
            held = [(w["lora_slots"], [i.split("\0")[0] for i in w["lora_resident"]]) for w in workers]
            if held == [(1, [model])] * 2:
                break
            time.sleep(0.1)
        assert held == [(1, [model])] * 2
