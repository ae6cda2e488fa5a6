"""OpenAI request validation: every refusal is a RequestError naming the field, and accepted requests
map onto the engine's SamplingParams."""
import json

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    choice_params,
    parse_request,
    prompt_token_ids_of,
    sampling_params,
)
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "demo", "prompt": "hello"}


def refusal(model_cls, body) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        parse_request(model_cls, raw)
    return info.value


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({**COMPLETION, **fields}).encode())


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())


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
])
def test_unsupported_parameters(model_cls, base, field, value, message):
    if message is None:
        parse_request(model_cls, json.dumps({**base, field: value}).encode())
        return
    error = refusal(model_cls, {**base, field: value})
    assert (error.message, error.param, error.status) == (message, field, 400)


def test_penalties_biases_and_min_p_map_to_the_engine():
    request = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100, "3": 2.5}, min_p=0.1,
                   repetition_penalty=1.2)
    params = sampling_params(request, 10, 100, vocab_size=64)
    assert (params.presence_penalty, params.frequency_penalty, params.min_p, params.repetition_penalty) == \
        (0.5, -1.0, 0.1, 1.2)
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert sampling_params(chat(presence_penalty=None), 10, 100).presence_penalty == 0


@pytest.mark.parametrize("body, message, param", [
    ({"logit_bias": {"x1": 5}}, "logit_bias: keys must be token ids (decimal strings), got 'x1'", "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1: Input should be a valid number", "logit_bias.1"),
])
def test_malformed_logit_bias_is_refused_naming_it(body, message, param):
    error = refusal(CompletionRequest, {**COMPLETION, **body})
    assert (error.message, error.param, error.status) == (message, param, 400)


@pytest.mark.parametrize("body, message, param", [
    ({"logit_bias": {"64": 1}}, "logit_bias: token id 64 is outside the vocabulary (ids 0..63)", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias maps token ids >= 0 to numbers in [-100, 100], got (5, 101.0)",
     "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5", "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10], got 0.0", "repetition_penalty"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5", "min_p"),
])
def test_out_of_range_penalties_and_biases_are_400s(body, message, param):
    with pytest.raises(RequestError) as info:
        sampling_params(parse_request(CompletionRequest, json.dumps({**COMPLETION, **body}).encode()), 10, 100, 64)
    assert (info.value.message, info.value.param, info.value.status) == (message, param, 400)


def test_logprobs_map_to_the_number_of_top_alternatives():
    assert sampling_params(completion(logprobs=3), 10, 100).logprobs == 3
    assert sampling_params(completion(logprobs=0), 10, 100).logprobs == 0
    assert sampling_params(completion(), 10, 100).logprobs is None
    assert sampling_params(chat(logprobs=True, top_logprobs=2), 10, 100).logprobs == 2
    assert sampling_params(chat(logprobs=True), 10, 100).logprobs == 0
    assert sampling_params(chat(logprobs=False), 10, 100).logprobs is None
    error = refusal(ChatCompletionRequest, {**CHAT, "top_logprobs": 2})
    assert (error.message, error.param) == ("top_logprobs: only allowed when logprobs is true", "top_logprobs")
    error = refusal(CompletionRequest, {**COMPLETION, "logprobs": 21})
    assert error.param == "logprobs" and "less than or equal to 20" in error.message


def test_values_that_change_nothing_are_accepted():
    request = chat(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False, top_logprobs=None,
                   response_format={"type": "text"}, tools=[], tool_choice="none", user="u1", seed=-1)
    assert request.n == 1 and request.user == "u1"
    assert completion(best_of=1, echo=False, suffix=None, logprobs=None).best_of == 1


def test_stream_options_need_stream():
    error = refusal(ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": True}})
    assert (error.message, error.param) == ("stream_options: only allowed when stream is true", "stream_options")
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options.include_usage is True
    assert chat(stream=False, stream_options=None).stream is False


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), ([1, 2, 3], [1, 2, 3]), (["text"], "text"), ([[4, 5]], [4, 5]), ("", ""),
])
def test_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt, message", [
    (["a", "b"], "prompt: batched prompts are not supported; send one request per prompt"),
    ([[1], [2]], "prompt: batched prompts are not supported; send one request per prompt"),
    ([], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
    ([[]], "prompt: must be a string or a non-empty list of token ids (integers >= 0)"),
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


def test_sampling_params_mapping():
    request = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["x", "yz"], min_tokens=2,
                         ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True, skip_special_tokens=False)
    assert sampling_params(request, 10, 100) == SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_k=5, top_p=0.9, seed=3, stop=("x", "yz"),
        stop_token_ids=(9,), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False)
    nulls = completion(temperature=None, top_p=None, stop="s", max_tokens=None)
    assert sampling_params(nulls, 10, 100) == SamplingParams(max_tokens=90, stop=("s",))


def test_default_max_tokens():
    assert sampling_params(completion(), 10, 100).max_tokens == 16  # OpenAI's completions default
    assert sampling_params(chat(), 10, 100).max_tokens == 90  # the rest of the context
    assert sampling_params(chat(max_completion_tokens=5), 10, 100).max_tokens == 5
    assert sampling_params(chat(max_tokens=6), 10, 100).max_tokens == 6
    assert sampling_params(chat(max_tokens=90), 10, 100).max_tokens == 90


def test_both_length_limits_are_refused():
    error = refusal(ChatCompletionRequest, {**CHAT, "max_tokens": 5, "max_completion_tokens": 5})
    assert error.param == "max_tokens" and "set only one" in error.message


@pytest.mark.parametrize("request_, field", [(completion(max_tokens=0), "max_tokens"),
                                             (chat(max_tokens=-3), "max_tokens"),
                                             (chat(max_completion_tokens=0), "max_completion_tokens")])
def test_max_tokens_at_least_one(request_, field):
    with pytest.raises(RequestError) as info:
        sampling_params(request_, 10, 100)
    value = getattr(request_, field)
    zero = " (0 only with echo, to score the prompt)" if isinstance(request_, CompletionRequest) else ""
    assert (info.value.message, info.value.param) == (f"{field} must be at least 1{zero}, got {value}", field)


def test_echo_asks_the_prefill_for_prompt_logprobs_and_max_tokens_0_scores_the_prompt_alone():
    scoring = completion(echo=True, max_tokens=0, logprobs=1)
    assert scoring.scores_prompt_only()
    params = sampling_params(scoring, 10, 100)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 1, 1)
    assert sampling_params(completion(echo=True), 10, 100).prompt_logprobs is None  # text only
    assert sampling_params(completion(logprobs=2), 10, 100).prompt_logprobs is None  # not echoed
    assert not completion(echo=True, max_tokens=3).scores_prompt_only()


def context_error(request, num_prompt_tokens, max_model_len) -> RequestError:
    with pytest.raises(RequestError) as info:
        sampling_params(request, num_prompt_tokens, max_model_len)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    return info.value


def test_prompt_longer_than_the_context():
    error = context_error(chat(), 100, 100)
    assert error.param == "messages"
    assert error.message == ("This model's maximum context length is 100 tokens. However, your prompt has 100 "
                             "tokens, which leaves no room for the completion. Please reduce the length of the messages.")
    assert context_error(completion(), 150, 100).param == "prompt"


def test_prompt_plus_completion_longer_than_the_context():
    error = context_error(completion(max_tokens=20), 90, 100)
    assert error.param == "max_tokens"
    assert error.message == ("This model's maximum context length is 100 tokens. However, you requested 110 tokens "
                             "(90 in the prompt, 20 in the completion). Please reduce the length of the prompt or "
                             "max_tokens.")
    error = context_error(chat(max_completion_tokens=91), 10, 100)
    assert error.param == "max_completion_tokens" and "(10 in the messages, 91 in the completion)" in error.message


@pytest.mark.parametrize("fields, param, message", [
    ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0, got -1.0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"top_k": 0}, "top_k", "top_k must be -1 (disabled) or >= 1, got 0"),
    ({"min_tokens": 20}, "min_tokens", "min_tokens must be an integer in [0, max_tokens=16], got 20"),
    ({"stop": ["ok", ""]}, "stop", "stop strings must be non-empty"),
])
def test_sampling_params_errors_name_the_field(fields, param, message):
    with pytest.raises(RequestError) as info:
        sampling_params(completion(**fields), 10, 100)
    assert (info.value.message, info.value.param, info.value.status) == (message, param, 400)


def test_prompt_token_ids():
    tok = ByteTokenizer()
    assert prompt_token_ids_of(completion(prompt="hi"), tok) == [tok.BOS, ord("h"), ord("i")]
    assert prompt_token_ids_of(completion(prompt=[[5, 258]]), tok) == [5, 258]
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


def test_slo_targets_reach_the_engine_in_seconds():
    assert sampling_params(completion(slo={"ttft_ms": 250, "tbt_ms": 40.5}), 10, 100) == SamplingParams(
        max_tokens=16, ttft_slo_s=0.25, tbt_slo_s=0.0405)
    only_tbt = sampling_params(chat(slo={"tbt_ms": 100}), 10, 100)
    assert (only_tbt.ttft_slo_s, only_tbt.tbt_slo_s) == (None, 0.1)
    assert sampling_params(chat(), 10, 100).tbt_slo_s is None  # the policy's default applies


@pytest.mark.parametrize("slo, param", [({"ttft_ms": 0}, "slo.ttft_ms"), ({"tbt_ms": -5}, "slo.tbt_ms"),
                                        ({"tbt_ms": "fast"}, "slo.tbt_ms"), ({"p99_ms": 5}, "slo.p99_ms")])
def test_bad_slo_targets_are_refused_naming_the_field(slo, param):
    assert refusal(CompletionRequest, {**COMPLETION, "slo": slo}).param == param


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("model_cls, base, fields, kind, spec", [
    (ChatCompletionRequest, CHAT, {"response_format": {"type": "json_object"}}, "json_object", ""),
    (ChatCompletionRequest, CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, "json_schema", json.dumps(SCHEMA, sort_keys=True)),
    (CompletionRequest, COMPLETION, {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     "json_schema", "{}"),
    (CompletionRequest, COMPLETION, {"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    (CompletionRequest, COMPLETION, {"structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]'),
    (ChatCompletionRequest, CHAT, {"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA, sort_keys=True)),
    (ChatCompletionRequest, CHAT, {"guided_grammar": "start: /a+/"}, "grammar", "start: /a+/"),
])
def test_structured_output_options_map_to_one_constraint(model_cls, base, fields, kind, spec):
    params = sampling_params(parse_request(model_cls, json.dumps({**base, **fields}).encode()), 10, 100)
    assert (params.constraint.kind, params.constraint.spec) == (kind, spec)
    text = parse_request(ChatCompletionRequest, json.dumps({**CHAT, "response_format": {"type": "text"}}).encode())
    assert sampling_params(text, 10, 100).constraint is None


@pytest.mark.parametrize("fields, param, needle", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format", "ignore_eos"),
])
def test_conflicting_or_malformed_structured_output_is_refused_naming_the_field(fields, param, needle):
    with pytest.raises(RequestError) as refused:
        sampling_params(parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode()), 10, 100)
    assert refused.value.param == param and needle in refused.value.message


TOOL = {"type": "function", "function": {"name": "weather", "description": "now",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tool_choice_required_or_named_forces_a_call_and_auto_or_none_do_not():
    def constraint(**fields):
        return chat(tools=[TOOL], **fields).output_constraint()

    forced, field = constraint(tool_choice="required")
    assert field == "tool_choice" and json.loads(forced.spec)["properties"]["name"] == {"const": "weather"}
    assert constraint(tool_choice={"type": "function", "function": {"name": "weather"}})[0] == forced
    assert constraint()[0] is None and constraint(tool_choice="auto")[0] is None
    assert chat(tools=[TOOL], tool_choice="none").tool_functions() == []
    assert chat(tools=[TOOL]).tool_functions() == [TOOL["function"]]


@pytest.mark.parametrize("fields, needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "no tool is named"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "pattern"),
])
def test_bad_tool_requests_are_refused_naming_the_field(fields, needle):
    with pytest.raises(RequestError) as refused:
        sampling_params(parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode()), 10, 100)
    assert refused.value.param.startswith(next(iter(k for k in fields if k != "tools"), "tools"))
    assert needle in refused.value.message


def test_n_and_best_of_give_the_choices_and_their_seed_streams():
    assert completion(n=3).num_choices() == (3, 3) and chat(n=2).num_choices() == (2, 2)
    ranked = completion(n=2, best_of=4)
    assert ranked.num_choices() == (4, 2)
    assert sampling_params(ranked, 10, 100).logprobs == 0  # ranking needs the sampled tokens' logprobs
    assert sampling_params(completion(n=2), 10, 100).logprobs is None
    params = sampling_params(completion(seed=7), 10, 100)
    assert [choice_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(sampling_params(completion(), 10, 100), 2).seed is None
    top = sampling_params(completion(seed=2**64 - 1), 10, 100)
    assert choice_params(top, 1).seed == 2**64 - 2


@pytest.mark.parametrize("fields, needle", [({"n": 3, "best_of": 2}, "at least n"),
                                            ({"best_of": 2, "stream": True}, "cannot stream")])
def test_best_of_below_n_or_streamed_is_refused(fields, needle):
    error = refusal(CompletionRequest, {**COMPLETION, **fields})
    assert error.param == "best_of" and needle in error.message
