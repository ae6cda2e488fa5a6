"""Response builders checked against the official `openai` package's own types, which accept extra
keys: every parsed object must also have none (a misspelt key would otherwise pass)."""
import json

import pytest
from pydantic import BaseModel

from splitserve.api.errors import RequestError
from splitserve.api.response_bodies import (
    SSE_DONE,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    model_card,
    models_list,
    new_request_id,
    sse_error,
    sse_event,
    usage_chunk,
)
from splitserve.api.usage import Usage

openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (a dependency of openai)
from openai.types import Completion, CompletionUsage, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

CREATED = 1_700_000_000


def parse(model_cls: type[BaseModel], data: dict, allowed_extra=()) -> BaseModel:
    parsed = model_cls.model_validate(data)
    assert_no_extra(parsed, set(allowed_extra))
    return parsed


def assert_no_extra(value, allowed_extra: set[str]):
    if isinstance(value, BaseModel):
        assert set(value.model_extra or {}) <= allowed_extra, (type(value).__name__, value.model_extra)
        for field in type(value).model_fields:
            assert_no_extra(getattr(value, field), allowed_extra)
    elif isinstance(value, list):
        for item in value:
            assert_no_extra(item, allowed_extra)


def test_request_ids():
    assert new_request_id("completion").startswith("cmpl-") and new_request_id("chat").startswith("chatcmpl-")
    assert new_request_id("chat") != new_request_id("chat")


def test_usage():
    parsed = parse(CompletionUsage, Usage(7, 3, 4).body())
    assert (parsed.prompt_tokens, parsed.completion_tokens, parsed.total_tokens) == (7, 3, 10)
    assert parsed.prompt_tokens_details.cached_tokens == 4
    assert Usage(7, 3, 4) + Usage(5, 1, 0) == Usage(12, 4, 4)


def test_usage_reads_back_from_either_body_shape():
    usage = Usage(90, 4, 64, 1, 16)
    assert Usage.from_body(usage.body()) == usage == Usage.from_body(usage.input_output_body())
    assert Usage.from_body({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}) == Usage(7, 3)


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_completion_response(finish_reason):
    body = completion_response("cmpl-1", "demo", CREATED, "text", finish_reason, Usage(5, 2))
    parsed = parse(Completion, body)
    assert parsed.object == "text_completion" and parsed.id == "cmpl-1" and parsed.model == "demo"
    assert parsed.created == CREATED and parsed.usage.total_tokens == 7
    choice, = parsed.choices
    assert (choice.index, choice.text, choice.logprobs, choice.finish_reason) == (0, "text", None, finish_reason)


def test_completion_chunks():
    last = parse(Completion, completion_chunk("cmpl-1", "demo", CREATED, "", "length"))
    assert last.choices[0].finish_reason == "length" and last.usage is None
    middle = completion_chunk("cmpl-1", "demo", CREATED, "tok")
    assert middle["choices"][0]["finish_reason"] is None  # OpenAI streams null until the last chunk
    parsed = parse(Completion, {**middle, "choices": [{**middle["choices"][0], "finish_reason": "stop"}]})
    assert parsed.choices[0].text == "tok" and "usage" not in middle


def test_chat_response():
    parsed = parse(ChatCompletion, chat_response("chatcmpl-1", "demo", CREATED, "hello", "stop", Usage(4, 1)))
    assert parsed.object == "chat.completion" and parsed.usage.completion_tokens == 1
    choice, = parsed.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "hello", "stop")


def test_chat_chunks():
    first = parse(ChatCompletionChunk, chat_chunk("chatcmpl-1", "demo", CREATED, role="assistant", content=""))
    assert first.object == "chat.completion.chunk"
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    middle = chat_chunk("chatcmpl-1", "demo", CREATED, content="tok")
    assert middle["choices"][0]["delta"] == {"content": "tok"}
    assert parse(ChatCompletionChunk, middle).choices[0].finish_reason is None
    last = chat_chunk("chatcmpl-1", "demo", CREATED, finish_reason="length")
    assert last["choices"][0]["delta"] == {}
    assert parse(ChatCompletionChunk, last).choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind, model_cls", [("completion", Completion), ("chat", ChatCompletionChunk)])
def test_usage_chunk(kind, model_cls):
    parsed = parse(model_cls, usage_chunk(kind, "id-1", "demo", CREATED, Usage(5, 6, 2)))
    assert parsed.choices == [] and parsed.usage.total_tokens == 11
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_error_body():
    error = RequestError("The model `x` does not exist.", status=404, param="model", code="model_not_found")
    assert error_body(error) == {"error": {"message": "The model `x` does not exist.", "type": "invalid_request_error",
                                           "param": "model", "code": "model_not_found"}}
    assert error_body(RequestError("bad"))["error"] == {"message": "bad", "type": "invalid_request_error",
                                                        "param": None, "code": None}


def test_error_body_is_what_the_openai_client_raises_from():
    body = error_body(RequestError("max_tokens: Input should be a valid integer", param="max_tokens"))
    request = httpx.Request("POST", "http://x/v1/completions")
    response = httpx.Response(400, json=body, request=request)
    client = openai.OpenAI(api_key="k", base_url="http://x/v1")
    error = client._make_status_error_from_response(response)
    assert isinstance(error, openai.BadRequestError)
    assert error.param == "max_tokens" and error.type == "invalid_request_error" and error.code is None
    assert "max_tokens: Input should be a valid integer" in str(error)


def test_sse_framing():
    event = sse_event({"a": "é", "b": [1, 2]})
    assert event == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    error = sse_error(RequestError("engine aborted the request", status=500, type="server_error"))
    assert error.startswith(b"data: ") and error.endswith(b"\n\n")
    assert json.loads(error[len(b"data: "):]) == {"error": {"message": "engine aborted the request",
                                                            "type": "server_error", "param": None, "code": None}}


def test_an_event_is_one_line_even_for_clients_that_split_with_str_splitlines():
    """Text from a byte-level model holds any character; U+2028, U+2029 and NEL stay escaped
    (found by the soak test: httpx's iter_lines cut an event there)."""
    text = "a\u2028b\u2029c\x85d\ne\rf\x1cg"
    event = sse_event({"text": text}).decode()
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):]) == {"text": text}


def test_sse_stream_parses_with_the_openai_decoder():
    from openai._streaming import SSEDecoder
    chunks = [chat_chunk("c", "demo", CREATED, role="assistant", content=""),
              chat_chunk("c", "demo", CREATED, content="hi\n\nthere"), chat_chunk("c", "demo", CREATED, finish_reason="stop")]
    stream = b"".join(sse_event(c) for c in chunks) + SSE_DONE
    events = list(SSEDecoder().iter_bytes(iter([stream])))
    assert [e.data for e in events[:-1]] == [json.dumps(c, separators=(",", ":")) for c in chunks]
    assert events[-1].data == "[DONE]"


def test_models_list():
    body = models_list("demo", CREATED)
    assert body["object"] == "list"
    parsed = parse(Model, body["data"][0])
    assert (parsed.id, parsed.object, parsed.created, parsed.owned_by) == ("demo", "model", CREATED, "splitserve")
    entry = models_list("demo", CREATED, owned_by="me", max_model_len=2048)["data"][0]
    parsed = parse(Model, entry, allowed_extra={"max_model_len"})
    assert parsed.owned_by == "me" and parsed.model_extra == {"max_model_len": 2048}
    aliases = models_list(("llama-3-8b", "gpt-3.5-turbo"), CREATED, max_model_len=8192)["data"]
    assert [parse(Model, e, allowed_extra={"max_model_len"}).id for e in aliases] == ["llama-3-8b", "gpt-3.5-turbo"]
    assert all(e["max_model_len"] == 8192 for e in aliases)
    card = parse(Model, model_card("org/llama", CREATED, max_model_len=8192), allowed_extra={"max_model_len"})
    assert (card.id, card.object, card.model_extra) == ("org/llama", "model", {"max_model_len": 8192})
