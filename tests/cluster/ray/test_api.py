"""The OpenAI API of a real local cluster, through the official `openai` client: completions,
chat, streaming with usage, greedy output equal to the offline engine's (with penalties and biases
too), and clear 4xx errors, those Serve's router gives (a query value, a route, a method) too."""
from __future__ import annotations

import gc
import uuid

import httpx
import openai
import pytest
import ray

from splitserve import SamplingParams
from tests.ray_cluster import count_reserves, worker_actor

PROMPT = "The disaggregated cluster says"


def offline_text(offline, prompt, max_tokens):
    out = offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    return out.text, out.token_ids


def test_health_and_models(server, client):
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200 and health.json()["ready"]
    models = client.models.list().data
    assert [(m.id, (m.model_extra or {}).get("parent")) for m in models] == \
        [("demo", None), ("demo-sql", "demo"), ("demo-chat", "demo")]


def test_the_clusters_own_actors_leave_their_start_up_heap_out_of_full_collections(server):
    """The CLS, the batch actor and the response store, as Serve does for its replicas."""
    for name in ("controller", "batches", "responses"):
        frozen = worker_actor("main", name).__ray_call__.remote(lambda actor: gc.get_freeze_count())
        assert ray.get(frozen, timeout=60) > 0, name


def test_tokenizer_endpoints(server):
    tokens = httpx.post(f"{server}/tokenize", json={"model": "demo", "prompt": "hi"}).json()["tokens"]
    assert tokens == [256, *b"hi"]
    assert httpx.post(f"{server}/detokenize", json={"tokens": tokens}).json() == {"prompt": "<s>hi"}
    assert httpx.get(f"{server}/tokenizer_info").json()["eos_token"] == "</s>"
    refused = httpx.post(f"{server}/tokenize", json={"prompt": "hi", "messages": []})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_completion_greedy_equals_offline_engine(client, offline):
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    text, tokens = offline_text(offline, PROMPT, 24)
    assert got.choices[0].text == text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(PROMPT.encode()) + 1, len(tokens))


def test_long_prompt_streams_kv_layer_by_layer_with_same_output(client, offline):
    prompt = "x" * 700  # >= the layer-wise threshold (512 tokens)
    got = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == offline_text(offline, prompt, 8)[0]


def test_streaming_completion_with_usage(client, offline):
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline, PROMPT, 20)[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it: a prompt sent again
    is prefilled from the prefix cache, all its whole blocks but the one holding its last token
    (BOS and 100 bytes: 101 tokens, 6 blocks of 16)."""
    prompt = f"Sent twice ({uuid.uuid4().hex}) ".ljust(100, "z")
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    assert (first.usage.prompt_tokens, first.usage.prompt_tokens_details.cached_tokens) == (101, 0)
    stream = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (101, 96)


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_its_salt(client):
    """vLLM's cache_salt: the same prompt under another salt, or none, finds none of its blocks."""
    prompt = f"Salted ({uuid.uuid4().hex}) ".ljust(100, "z")

    def cached_tokens(**salt) -> int:
        answer = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0, extra_body=salt)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert [cached_tokens(cache_salt="a"), cached_tokens(cache_salt="b"), cached_tokens()] == [0, 0, 0]
    assert [cached_tokens(cache_salt="a"), cached_tokens(cache_salt="b"), cached_tokens()] == [96, 96, 96]


@pytest.mark.parametrize("prompt", [PROMPT, "y" * 700], ids=["one-shot", "layer-wise"])
def test_penalties_and_biases_give_the_offline_engines_text_streamed_and_not(client, offline, prompt):
    """The first token is sampled on the prompt worker, the rest on the token worker: both apply
    them, so the text equals one engine's (and differs from the unpenalized text)."""
    bias = {ord("e"): 8.0, ord(" "): -5.0}  # the demo model's byte tokenizer: token id = byte
    options = dict(frequency_penalty=0.7, presence_penalty=0.4, logit_bias={str(t): b for t, b in bias.items()})
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4,
                            logit_bias=bias, repetition_penalty=1.3, min_p=0.05)
    expected = offline.generate([prompt], params)[0].text
    got = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, extra_body=extra,
                                    **options)
    stream = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       extra_body=extra, **options)
    assert got.choices[0].text == expected == "".join(c.choices[0].text for c in stream)
    assert expected != offline_text(offline, prompt, 24)[0]


def test_bad_words_and_allowed_token_ids_give_the_offline_engines_text(client, offline):
    """Both workers ban: the first token on the prompt worker, the rest on the token worker; a bad
    word's later tokens are banned after its first ones whichever worker sampled them."""
    plain = offline_text(offline, PROMPT, 24)[0]
    words, allowed = [plain[2:5], plain[9]], sorted({ord(c) for c in plain[:6] + "etaoin shrdlu"})
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=words, allowed_token_ids=allowed)
    expected = offline.generate([PROMPT], params)[0].text
    extra = {"ignore_eos": True, "bad_words": words, "allowed_token_ids": allowed}
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert got.choices[0].text == expected != plain
    assert set(expected) <= {chr(t) for t in allowed} and not any(word in expected for word in words)


def test_tokens_named_by_their_ids_are_the_offline_engines_ids_streamed_and_not(client, offline):
    """vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:{id}` (chat's and
    completions', the alternatives too), with the text's offsets and bytes."""
    out = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))[0]
    named = [f"token_id:{t}" for t in out.token_ids]
    spelled = [offline.engine.tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    args = dict(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, extra_body=extra)
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args) if c.choices]
    assert whole.tokens == [t for c in chunks for t in c.tokens] == named
    assert whole.text_offset == [t for c in chunks for t in c.text_offset] == \
        [sum(map(len, spelled[:i])) for i in range(len(spelled))]
    assert all(set(top) <= {f"token_id:{t}" for t in range(259)} for top in whole.top_logprobs)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    content = chat.choices[0].logprobs.content
    ids = [int(item.token.removeprefix("token_id:")) for item in content]
    assert [bytes(item.bytes) for item in content] == [offline.engine.tokenizer.token_bytes(t) for t in ids]
    assert all(top.token.startswith("token_id:") for item in content for top in item.top_logprobs)


@pytest.mark.parametrize("prompt", [PROMPT, "z" * 700], ids=["one-shot", "layer-wise"])
def test_logprobs_equal_the_offline_engines_whole_and_streamed(client, offline, prompt):
    """The first token's logprobs come from the prompt worker, the rest from the token worker:
    all equal one local engine's, and the tokens spell the text."""
    out = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))[0]
    expected = [lps[t] for t, lps in zip(out.token_ids, out.outputs[0].logprobs)]
    spelled = [offline.engine.tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]
    args = dict(model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    for tokens, logprobs, tops, text in (
            (whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.logprobs.top_logprobs, whole.text),
            ([t for c in chunks for t in c.logprobs.tokens], [v for c in chunks for v in c.logprobs.token_logprobs],
             [d for c in chunks for d in c.logprobs.top_logprobs], "".join(c.text for c in chunks))):
        assert tokens == spelled and text == out.text
        assert logprobs == pytest.approx(expected, abs=1e-4)
        # keyed by token text: two byte tokens that both spell U+FFFD share a key, as in OpenAI's format
        assert all(1 <= len(top) <= 2 and max(top.values()) <= lp + 1e-4 for top, lp in zip(tops, logprobs))


@pytest.mark.parametrize("prompt", [PROMPT, "z" * 700], ids=["one-shot", "layer-wise"])
def test_echo_scores_the_prompt_with_the_prompt_workers_logprobs_whole_and_streamed(client, offline, prompt):
    """What evaluation harnesses send (echo, logprobs, max_tokens 0): the prompt's text and its
    tokens' logprobs, computed by the prompt worker's prefill, equal to one local engine's."""
    out = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1))[0]
    ids = out.prompt_token_ids
    expected = [lps[t] for t, lps in zip(ids[1:], out.prompt_logprobs[1:])]
    scored = client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    chunks = [c.choices[0] for c in client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=1,
                                                              max_tokens=0, stream=True) if c.choices]
    whole = scored.choices[0]
    assert scored.usage.completion_tokens == 0 and whole.text == prompt == "".join(c.text for c in chunks)
    for logprobs in (whole.logprobs.token_logprobs, [v for c in chunks for v in c.logprobs.token_logprobs]):
        assert len(logprobs) == len(ids) and logprobs[0] is None
        assert logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert whole.logprobs.top_logprobs[0] is None and all(len(top) == 1 for top in whole.logprobs.top_logprobs[1:])
    generated = client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=0, max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert generated.text == prompt + out.text and len(generated.logprobs.tokens) == len(ids) + 4


def test_a_scoring_request_runs_on_its_prompt_worker_alone(server, client):
    """Echo with max_tokens 0 (what evaluation harnesses send) or a one-token answer: its token is
    the prefill's, so the prompt worker runs it whole and no token worker reserves or receives its
    KV, however long the prompt; a request that decodes still goes to the token worker."""
    status = httpx.get(f"{server}/v1/cluster/status").json()
    token = worker_actor("main", next(w for w, s in status["workers"].items() if s["pool"] == "token"))
    ray.get(token.__ray_call__.remote(count_reserves), timeout=60)
    try:
        for prompt in (PROMPT, "s" * 700):
            client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
            client.completions.create(model="demo", prompt=prompt, max_tokens=1)
        assert ray.get(token.__ray_call__.remote(lambda actor: actor.reserves), timeout=60) == 0
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
        assert ray.get(token.__ray_call__.remote(lambda actor: actor.reserves), timeout=60) == 1
    finally:
        ray.get(token.__ray_call__.remote(lambda actor: delattr(actor.loop, "reserve")), timeout=60)


def test_chat_logprobs_whole_and_streamed(client):
    args = dict(model="demo", messages=[{"role": "user", "content": "Log my probabilities"}], max_tokens=10,
                temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **args) if c.choices]
    content = [item for c in streamed if c.logprobs for item in c.logprobs.content]
    assert [(i.token, i.bytes) for i in whole.logprobs.content] == [(i.token, i.bytes) for i in content]
    assert len(content) == 10 and [i.logprob for i in content] == pytest.approx([i.logprob for i in whole.logprobs.content])
    assert all(len(i.top_logprobs) == 3 and i.top_logprobs[0].logprob >= i.top_logprobs[-1].logprob for i in content)


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens <= 16
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    ignored = dict(store=False, metadata={"job": "eval"}, service_tier="auto", modalities=["text"], user="u1")
    same = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0, **ignored)
    assert same.choices[0].message.content == whole.choices[0].message.content


def test_chat_continues_a_prefilled_answer(client, offline):
    """continue_final_message: the model goes on from the assistant's words (no new turn opened),
    so the reply equals the engine's continuation of that exact text."""
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My answer is"}]
    got = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    assert got.choices[0].message.content == offline_text(offline, "user: Name a colour\nassistant: My answer is", 8)[0]


def test_truncated_prompt_keeps_its_last_tokens(client, offline):
    got = client.completions.create(model="demo", prompt="drop this, keep the tail", max_tokens=6, temperature=0,
                                    echo=True, extra_body={"truncate_prompt_tokens": 8, "ignore_eos": True})
    text, _ = offline_text(offline, list(b"the tail"), 6)
    assert got.choices[0].text == "the tail" + text and got.usage.prompt_tokens == 8


def test_stop_string_ends_the_text_at_the_ingress(client, offline):
    text, _ = offline_text(offline, PROMPT, 24)
    stop = text[5:7]
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "nope", "prompt": "hi"}', 404, "does not exist"),
    (b'{"model": "demo", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "demo", "prompt": "hi", "n": 0}', 400, "n"),
    (b'{"model": "demo", "prompt": "hi", "suffix": "end"}', 400, "suffix"),
    (b'{"model": "demo", "prompt": "hi", "frobnicate": 1}', 400, "frobnicate"),
    (b'{"model": "demo", "prompt": "hi", "priority": -1}', 400, "priority: this server schedules first come"),
    (b'{"model": "demo", "prompt": "' + b"y" * 2100 + b'"}', 400, "maximum context length"),
])
def test_bad_requests_get_openai_error_bodies(server, body, status, needle):
    response = httpx.post(f"{server}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]


@pytest.mark.parametrize("method, path, status, needle", [
    ("GET", "/v1/batches?limit=ten", 400, "limit"),
    ("POST", "/v1/cluster/workers/w/drain?replace=maybe", 400, "replace"),
    ("GET", "/v1/nowhere", 404, "GET /v1/nowhere"),
    ("DELETE", "/v1/models", 405, "DELETE /v1/models"),
])
def test_requests_the_router_refuses_get_openai_error_bodies_through_serve(server, method, path, status, needle):
    response = httpx.request(method, f"{server}{path}")
    assert response.status_code == status and needle in response.json()["error"]["message"]


def test_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
