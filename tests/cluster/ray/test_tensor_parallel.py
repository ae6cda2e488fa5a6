"""A prompt worker of 2 tensor-parallel ranks (a placement group of 2 bundles, gloo between the
ranks) handing its KV to a token worker of 1 that drafts tokens by n-gram lookup
(num_speculative_tokens), through the OpenAI API: greedy output and logprobs as the offline
one-rank engine's (which drafts nothing), on the base model and under a LoRA adapter, streamed too;
a chat's prediction drafted from and counted in its usage."""
from __future__ import annotations

import time

import pytest

from splitserve.engine.sampling_params import SamplingParams
from tests.cluster.ray.test_hardening import metric


@pytest.mark.parametrize("model", ["demo", "demo-chat"])
def test_tp2_prompt_worker_hands_to_tp1_token_worker(tp_server, offline, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tp_server}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in ("Tensor parallel prompt workers", "x" * 700):  # one-shot, then layer-wise (>= 512 tokens)
        got = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1,
                                                         lora=None if model == "demo" else model))[0]
        assert got.choices[0].text == want.text
        theirs = [max(lp.values()) for lp in want.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got.choices[0].logprobs.token_logprobs, theirs)) < 1e-4


def test_a_stream_of_drafted_tokens_is_the_offline_engines_text(tp_server, offline):
    """The token worker's steps give several tokens at once where drafts are kept: the stream carries
    them in order, and its drafts reach /metrics with its next load report."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tp_server}/v1", api_key="unused", max_retries=0, timeout=120)
    kept_before = metric(tp_server, "splitserve_spec_decode_accepted_tokens_total")
    for prompt in ("abcabcabcabc", "the cat sat on the mat; the cat sat on the"):
        stream = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        want = offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want.text
    deadline = time.monotonic() + 10
    while metric(tp_server, "splitserve_spec_decode_accepted_tokens_total") <= kept_before:
        assert time.monotonic() < deadline, "no drafts kept reached /metrics"
        time.sleep(0.1)


def test_a_chats_prediction_drafts_on_the_token_worker_and_usage_counts_them(tp_server):
    """Predicted Outputs through the openai client: the answer itself as the prediction gives the same
    answer, most of it from kept drafts (usage's completion_tokens_details), streamed too."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tp_server}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = dict(model="demo", messages=[{"role": "user", "content": "Rename x to y"}], max_tokens=40, temperature=0,
               extra_body={"ignore_eos": True, "allowed_token_ids": list(range(32, 127))})  # text that reads back
    first = client.chat.completions.create(**ask)
    answer = first.choices[0].message.content
    assert first.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = client.chat.completions.create(**ask, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 20 and details.rejected_prediction_tokens >= 0
    stream = client.chat.completions.create(**ask, prediction={"type": "content", "content": answer}, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 20


def test_the_tp_workers_ranks_share_a_placement_group(tp_server):
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values() if g["name"].startswith("tp-prompt-")]
    assert len(groups) == 1 and groups[0]["state"] == "CREATED" and groups[0]["strategy"] == "STRICT_PACK"
    assert len(groups[0]["bundles"]) == 2
