"""OpenAI request validation: bodies, prompts, messages and models; every refusal is a RequestError
naming the field."""
import json

import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest, check_model, parse_request, prompt_token_ids_of
from splitserve.engine.tokenizer import ByteTokenizer

from tests.api.request_helpers import CHAT, COMPLETION, chat, completion, refusal


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe{", b'{"model": "demo",}'])
def test_bad_json(raw):
    error = refusal(CompletionRequest, raw)
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.message.startswith("request body is not valid JSON: ")


@pytest.mark.parametrize("raw, kind", [(b"[1]", "list"), (b'"x"', "str"), (b"null", "NoneType")])
def test_body_must_be_an_object(raw, kind):
    assert refusal(ChatCompletionRequest, raw).message == f"request body must be a JSON object, got {kind}"


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", "16", "max_tokens: Input should be a valid integer"),
    ("max_tokens", 1.5, "max_tokens: Input should be a valid integer"),
    ("max_tokens", True, "max_tokens: Input should be a valid integer"),
    ("temperature", "hot", "temperature: Input should be a valid number"),
    ("stream", "yes", "stream: Input should be a valid boolean"),
    ("stop", 5, "stop: must be a string, a list of strings, or null"),
    ("stop", ["a", 1], "stop: must be a string, a list of strings, or null"),
    ("seed", 2**64, "seed: Input should be less than or equal to 18446744073709551615"),
    ("stop_token_ids", [1, "2"], "stop_token_ids.1: Input should be a valid integer"),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage: Input should be a valid boolean"),
])
def test_wrong_types_name_the_field(field, value, message):
    error = refusal(CompletionRequest, {**COMPLETION, field: value, "stream": True} if field == "stream_options"
                    else {**COMPLETION, field: value})
    assert error.message == message and error.param == message.split(":")[0] and error.status == 400


def test_missing_and_unknown_fields():
    error = refusal(CompletionRequest, {"model": "demo"})
    assert (error.message, error.param) == ("prompt: Field required", "prompt")
    error = refusal(ChatCompletionRequest, {**CHAT, "frobnicate": 1})
    assert (error.message, error.param) == ("frobnicate: unsupported parameter", "frobnicate")
    error = refusal(CompletionRequest, {**COMPLETION, "stream": True, "stream_options": {"x": 1}})
    assert (error.message, error.param) == ("stream_options.x: unsupported parameter", "stream_options.x")


@pytest.mark.parametrize("model_cls, base, field, value, message", [
    (ChatCompletionRequest, CHAT, "n", 0, "n: Input should be greater than or equal to 1"),
    (CompletionRequest, COMPLETION, "n", 17, "n: Input should be less than or equal to 16"),
    (CompletionRequest, COMPLETION, "best_of", 0, "best_of: Input should be greater than or equal to 1"),
    (CompletionRequest, COMPLETION, "suffix", "end", "suffix: is not supported, got 'end'"),
    (CompletionRequest, COMPLETION, "suffix", None, None),  # null is the default for every one of them
    (ChatCompletionRequest, CHAT, "modalities", ["text", "audio"],
     "modalities: only text output is supported, got ['text', 'audio']"),
    (CompletionRequest, COMPLETION, "metadata", {f"k{i}": "v" for i in range(17)},
     "metadata: at most 16 pairs, keys of at most 64 characters and values of at most 512"),
    (ChatCompletionRequest, CHAT, "prompt_cache_retention", "forever",
     "prompt_cache_retention: Input should be 'in_memory' or '24h'"),
    (ChatCompletionRequest, CHAT, "service_tier", "fastest",
     "service_tier: Input should be 'auto', 'default', 'flex', 'scale' or 'priority'"),
])
def test_unsupported_parameters(model_cls, base, field, value, message):
    if message is None:
        parse_request(model_cls, json.dumps({**base, field: value}).encode())
        return
    error = refusal(model_cls, {**base, field: value})
    assert (error.message, error.param, error.status) == (message, field, 400)


def test_values_that_change_nothing_are_accepted():
    request = chat(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False, top_logprobs=None,
                   response_format={"type": "text"}, tools=[], tool_choice="none", user="u1", seed=-1)
    assert request.n == 1 and request.user == "u1"
    chat(store=False, metadata={"job": "eval"}, service_tier="auto", modalities=["text"], prompt_cache_key="k",
         prompt_cache_retention="24h", safety_identifier="user-hash")
    completion(store=True, metadata={}, service_tier="default")
    assert completion(best_of=1, echo=False, suffix=None, logprobs=None).best_of == 1


def test_stream_options_need_stream():
    error = refusal(ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": True}})
    assert (error.message, error.param) == ("stream_options: only allowed when stream is true", "stream_options")
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options.include_usage is True
    assert chat(stream=False, stream_options=None).stream is False


@pytest.mark.parametrize("prompt, expected", [
    ("text", ["text"]), ([1, 2, 3], [[1, 2, 3]]), (["text"], ["text"]), ([[4, 5]], [[4, 5]]), ("", [""]),
    (["a", "b"], ["a", "b"]), ([[1], "b", [2, 3]], [[1], "b", [2, 3]]),
])
def test_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt, message", [
    (["a", []], "prompt: prompt 1: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([[1], [-2]], "prompt: prompt 1: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([[]], "prompt: prompt 0: must be a string or a non-empty list of token ids (integers >= 0)"),
    (["a", 5], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([1, -2], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([1, 2.0], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([True], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    (5, "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
])
def test_bad_prompts(prompt, message):
    error = refusal(CompletionRequest, {**COMPLETION, "prompt": prompt})
    assert (error.message, error.param) == (message, "prompt")


def test_chat_messages():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {}}]
    request = chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": parts, "name": "x"}])
    assert [p.text for p in request.messages[1].content] == ["a", "b"] and request.messages[0].content is None


@pytest.mark.parametrize("messages, message", [
    ([], "messages: List should have at least 1 item after validation, not 0"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content: only text content parts are supported, got a part of type 'image_url'"),
    ([{"role": "user", "content": ["hi"]}],
     "messages.0.content: only text content parts are supported, got a part of type 'str'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content: a text content part needs a string field 'text'"),
    ([{"role": "user", "content": 3}], "messages.0.content: must be a string, a list of content parts, or null"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     "messages.1.role: Input should be 'system', 'user', 'assistant', 'tool' or 'developer'"),
    ([{"role": "user"}], "messages.0.content: Field required"),
    ([{"role": "user", "content": "a", "audio": {}}], "messages.0.audio: unsupported parameter"),
])
def test_bad_messages(messages, message):
    error = refusal(ChatCompletionRequest, {**CHAT, "messages": messages})
    assert error.message == message and error.param == message.split(":")[0]
    assert error.param.startswith("messages")


def test_chat_template_kwargs():
    assert chat(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {"enable_thinking": False}
    error = refusal(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert error.param == "chat_template_kwargs"
    assert "'add_generation_prompt' comes from the request's own field" in error.message


def test_reasoning_effort():
    assert chat(reasoning_effort="low").reasoning_effort == "low" and chat().reasoning_effort is None
    assert refusal(ChatCompletionRequest, {**CHAT, "reasoning_effort": "extreme"}).param == "reasoning_effort"
    error = refusal(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert error.param == "chat_template_kwargs" and "'reasoning_effort' comes from the request's own field" in error.message


def test_unknown_model_is_404():
    check_model("demo", "demo")
    with pytest.raises(RequestError) as info:
        check_model("gpt-4", "demo")
    error = info.value
    assert (error.status, error.type, error.code, error.param) == (404, "invalid_request_error", "model_not_found", "model")
    assert error.message == "The model `gpt-4` does not exist. This server serves `demo`."
    check_model("gpt-3.5-turbo", ("llama", "gpt-3.5-turbo"))  # any alias
    with pytest.raises(RequestError, match="serves `llama`, `gpt-3.5-turbo`"):
        check_model("llama2", ("llama", "gpt-3.5-turbo"))


def test_prompt_token_ids():
    tok = ByteTokenizer()
    assert prompt_token_ids_of(completion(prompt="hi"), tok) == [[tok.BOS, ord("h"), ord("i")]]
    assert prompt_token_ids_of(completion(prompt=[[5, 258]]), tok) == [[5, 258]]
    assert prompt_token_ids_of(completion(prompt=["hi", [5]]), tok) == [[tok.BOS, ord("h"), ord("i")], [5]]
    with pytest.raises(RequestError) as info:
        prompt_token_ids_of(completion(prompt=[5, 259]), tok)
    assert info.value.param == "prompt"
    assert info.value.message == "prompt: token id 259 is outside the vocabulary (ids 0..258)"


def test_prompt_that_encodes_to_nothing():
    class NoBos(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return super().encode(text, add_special_tokens=False)

    with pytest.raises(RequestError, match="prompt: the prompt is empty"):
        prompt_token_ids_of(completion(prompt=""), NoBos())
