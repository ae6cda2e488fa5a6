"""Property-based fuzzing of the HTTP API on a real cluster (hypothesis): generated bodies for
/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /score, /rerank, /v1/batches
and /v1/conversations (new ones, and items added to one), from raw bytes and arbitrary JSON to
near-valid requests with hostile values. No answer is a 5xx, every 4xx carries OpenAI's error
body, and the cluster serves an ordinary request afterwards.

SPLITSERVE_FUZZ_EXAMPLES sets the examples per endpoint (CI: a bounded 120)."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "120"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=20)
hostile_numbers = st.sampled_from([0, -1, 1, 2, 1e-300, 1e300, -0.0, 2**63, 2**64, -2**63 - 1, 0.5, 1.0000001])
small_ints = st.integers(-3, 8)


def _field(valid, weight_valid: int = 3):
    """Mostly a plausible value, sometimes a hostile number or any JSON value."""
    return st.one_of(*[valid] * weight_valid, hostile_numbers, json_values)


SAMPLING = {
    "max_tokens": _field(small_ints), "temperature": _field(st.floats(0, 2)), "top_p": _field(st.floats(0, 1)),
    "top_k": _field(st.integers(-2, 70)), "n": _field(st.integers(0, 3)), "seed": _field(st.integers()),
    "stop": _field(st.lists(st.text(max_size=40), max_size=6) | st.text(max_size=40)),
    "stop_token_ids": _field(st.lists(st.integers(-5, 300), max_size=10)), "min_tokens": _field(small_ints),
    "ignore_eos": _field(st.booleans()), "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                 "continuous_usage_stats": st.booleans()})),
    "presence_penalty": _field(st.floats(-2, 2)), "frequency_penalty": _field(st.floats(-2, 2)),
    "repetition_penalty": _field(st.floats(0.5, 2)), "min_p": _field(st.floats(0, 1)),
    "logit_bias": _field(st.dictionaries(st.integers(-5, 300).map(str), st.floats(-100, 100), max_size=5)),
    "allowed_token_ids": _field(st.lists(st.integers(-5, 300), max_size=6)),
    "bad_words": _field(st.lists(st.text(max_size=12), max_size=4)), "cache_salt": _field(st.text(max_size=12)),
    "return_tokens_as_token_ids": _field(st.booleans()), "priority": _field(st.integers(-3, 3)),
    "user": _field(st.text(max_size=20)),
    "slo": _field(st.fixed_dictionaries({}, optional={"ttft_ms": st.floats(-1, 1e4), "tbt_ms": st.floats(-1, 1e4)})),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                                 "content": st.text(max_size=60) | st.lists(
                                     st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                            "text": st.text(max_size=20)}), max_size=3)})


RESPONSES_OPTIONS = {
    "instructions": _field(st.text(max_size=60)), "max_output_tokens": _field(small_ints),
    "temperature": _field(st.floats(0, 2)), "top_p": _field(st.floats(0, 1)), "stream": _field(st.booleans()),
    "text": _field(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar"])},
        optional={"name": st.text(max_size=10), "schema": json_values, "strict": st.booleans()})})),
    "tools": _field(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                    "name": st.text(max_size=10)},
                                                   optional={"parameters": json_values}), max_size=3)),
    "tool_choice": _field(st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.text(max_size=10)}) | st.fixed_dictionaries(
        {"type": st.just("allowed_tools"), "mode": st.sampled_from(["auto", "required", "any"]),
         "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.text(max_size=10)}),
                           max_size=3)})),
    "reasoning": _field(st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high", "max"]),
                                                            "summary": st.sampled_from(["auto", None])})),
    "previous_response_id": _field(st.text(max_size=10)),
    "conversation": _field(st.text(max_size=10) | st.fixed_dictionaries({"id": st.text(max_size=10)})),
    "truncation": _field(st.sampled_from(["auto", "disabled"])),
    "include": _field(st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                               max_size=2)),
    "top_logprobs": _field(st.integers(-1, 21)), "store": _field(st.booleans()),
}  # not `background`: its runs would outlive the test
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "assistant", "tool"]),
                           "content": st.text(max_size=60) | st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": st.text(max_size=20)}), max_size=3)},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=8),
                           "name": st.text(max_size=8), "arguments": st.text(max_size=30)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=8),
                           "output": st.text(max_size=30)}),
    st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"content": json_values, "summary": json_values}))


def _near_valid(required: dict, options: dict = SAMPLING) -> st.SearchStrategy:
    return st.builds(lambda base, extra, junk: {**base, **extra, **junk},
                     st.fixed_dictionaries(required),
                     st.fixed_dictionaries({}, optional=options),
                     st.dictionaries(st.text(max_size=10), json_values, max_size=2))


def _bodies(near_valid: st.SearchStrategy) -> st.SearchStrategy:
    """Raw bytes, any JSON, or a near-valid request, as the bytes of a body."""
    return st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                     *[near_valid.map(lambda v: json.dumps(v).encode())] * 6)


COMPLETIONS = _bodies(_near_valid({"model": _field(st.just("demo"), 8), "prompt": _field(
    st.text(min_size=1, max_size=200) | st.lists(st.integers(-2, 300), min_size=1, max_size=50))}))
CHAT = _bodies(_near_valid({"model": _field(st.just("demo"), 8),
                            "messages": _field(st.lists(MESSAGE, min_size=1, max_size=10))}))
RESPONSES = _bodies(_near_valid({"model": _field(st.just("demo"), 8),
                                 "input": _field(st.text(max_size=100) | st.lists(ITEM, min_size=1, max_size=8))},
                                RESPONSES_OPTIONS))
TEXTS = _field(st.text(max_size=120) | st.lists(st.integers(-2, 300), max_size=40)
               | st.lists(st.text(max_size=60) | st.lists(st.integers(-2, 300), max_size=20), max_size=8))
EMBEDDINGS = _bodies(_near_valid({"model": _field(st.just("demo"), 8), "input": TEXTS}, {
    "encoding_format": _field(st.sampled_from(["float", "base64", "int8"])),
    "dimensions": _field(st.integers(-1, 300)), "user": _field(st.text(max_size=20))}))
SCORE = _bodies(_near_valid({"model": _field(st.just("demo"), 8), "text_1": TEXTS, "text_2": TEXTS}, {}))
RERANK = _bodies(_near_valid({"model": _field(st.just("demo"), 8), "query": _field(st.text(max_size=100)),
                              "documents": _field(st.lists(st.text(max_size=80) | st.fixed_dictionaries(
                                  {"text": st.text(max_size=40)}), max_size=10))},
                             {"top_n": _field(st.integers(-1, 12)), "return_documents": _field(st.booleans()),
                              "max_tokens_per_doc": _field(st.integers(-1, 50))}))


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert "param" in error and "code" in error


def post(http: httpx.Client, url: str, body: bytes) -> httpx.Response:
    with http.stream("POST", url, content=body, headers={"content-type": "application/json"}) as response:
        response.read()  # a stream's every event (an error event ends a broken stream with 200)
    return response


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def batch_file(hardening_server, http):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "demo", "prompt": "hi", "max_tokens": 1}}
    response = http.post(f"{hardening_server}/v1/files", files={"file": ("f.jsonl", json.dumps(line).encode())},
                         data={"purpose": "batch"})
    return response.json()["id"]


@pytest.mark.parametrize("path, bodies", [("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHAT),
                                          ("/v1/responses", RESPONSES), ("/v1/embeddings", EMBEDDINGS),
                                          ("/score", SCORE), ("/v2/rerank", RERANK)])
def test_request_endpoints(hardening_server, http, path, bodies):
    @SETTINGS
    @given(body=bodies)
    def run(body):
        check_answer(post(http, f"{hardening_server}{path}", body))
    run()


def test_batches(hardening_server, http, batch_file):
    fields = st.fixed_dictionaries(
        {"input_file_id": _field(st.sampled_from([batch_file, "file-nope"]), 4),
         "endpoint": _field(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                             "/v1/embeddings"]))},
        optional={"completion_window": _field(st.sampled_from(["24h", "1h"])), "metadata": json_values})

    @SETTINGS
    @given(body=_bodies(fields))
    def run(body):
        check_answer(post(http, f"{hardening_server}/v1/batches", body))
    run()


def test_conversations(hardening_server, http):
    conversation = http.post(f"{hardening_server}/v1/conversations", json={}).json()["id"]
    items = _field(st.lists(ITEM, max_size=22))
    new = _bodies(st.fixed_dictionaries({}, optional={"items": items, "metadata": _field(st.dictionaries(
        st.text(max_size=70), st.text(max_size=20), max_size=18))}))
    added = _bodies(st.fixed_dictionaries({"items": items}))

    @SETTINGS
    @given(body=new, more=added)
    def run(body, more):
        check_answer(post(http, f"{hardening_server}/v1/conversations", body))
        check_answer(post(http, f"{hardening_server}/v1/conversations/{conversation}/items", more))
    run()


def test_the_cluster_serves_an_ordinary_request_after_the_fuzzing(hardening_server, http):
    response = http.post(f"{hardening_server}/v1/completions", json={"model": "demo", "prompt": "still here",
                                                                     "max_tokens": 4})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None
    assert http.get(f"{hardening_server}/health").json()["ready"]
