"""A body taken as its endpoint takes it: each prompt tokenized with settings of its own, a chat
through its template, and the model name, the bounds and the context checked with the field named."""
from __future__ import annotations

import json

import pytest

from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.chat_template import chat_prompt_token_ids
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.prepared_request import prepare_request
from splitserve.api.request_models import ServedModels, parse_request
from splitserve.api.request_sampling import choice_params
from splitserve.engine.demo import demo_tokenizer

TOKENIZER = demo_tokenizer()


def prepare(kind: str, limits: RequestLimits = RequestLimits(), max_model_len: int = 64,
            parsers: ChatParsers = ChatParsers(), **body):
    return prepare_request(kind, json.dumps({"model": "demo", **body}).encode(), TOKENIZER, ("demo", "alias"),
                           max_model_len, limits, parsers=parsers)


def test_each_prompt_has_its_token_ids_and_its_own_room_in_the_context():
    prepared = prepare("completion", prompt=["ab", [7, 8, 9, 10]], n=2, max_tokens=None)
    assert prepared.prompts == [TOKENIZER.encode("ab"), [7, 8, 9, 10]]
    assert [p.max_tokens for p in prepared.params] == [64 - 3, 64 - 4]  # what the context leaves each
    assert prepared.request.num_choices() == (2, 2)


def test_a_chat_is_one_prompt_through_its_template():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    prepared = prepare("chat", **body)
    chat = parse_request(ChatCompletionRequest, json.dumps({"model": "demo", **body}).encode())
    assert prepared.prompts == [chat_prompt_token_ids(chat, TOKENIZER)] and prepared.params[0].max_tokens == 5


@pytest.mark.parametrize("content", ["def f(x):\n    return x", [{"type": "text", "text": "def f(x):\n"},
                                                                    {"type": "text", "text": "    return x"}]])
def test_a_chats_prediction_is_the_answers_tokens_for_every_choice(content):
    prepared = prepare("chat", messages=[{"role": "user", "content": "hi"}], n=2,
                       prediction={"type": "content", "content": content})
    want = tuple(TOKENIZER.encode("def f(x):\n    return x", add_special_tokens=False))
    [params] = prepared.params
    assert params.prediction == choice_params(params, 1).prediction == want and TOKENIZER.bos_token_id not in want
    assert prepare("chat", messages=[{"role": "user", "content": "hi"}]).params[0].prediction == ()


@pytest.mark.parametrize("prediction, limits, status", [
    ({"type": "content", "content": "x" * 65}, RequestLimits(), 400),  # 65 tokens: more than the context
    ({"type": "content", "content": "x" * 11}, RequestLimits(max_prompt_chars=10), 413),
    ({"type": "file", "content": "x"}, RequestLimits(), 400),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {}}]}, RequestLimits(), 400),
    ({"type": "content"}, RequestLimits(), 400),
    ({"type": "content", "content": None}, RequestLimits(), 400),
])
def test_a_bad_prediction_is_refused_naming_it(prediction, limits, status):
    with pytest.raises(RequestError) as refused:
        prepare("chat", limits, messages=[{"role": "user", "content": "hi"}], prediction=prediction)
    assert (refused.value.status, refused.value.param.split(".")[0]) == (status, "prediction")


JSON = {"response_format": {"type": "json_object"}, "max_tokens": 8}


@pytest.mark.parametrize("kind, body", [("completion", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 4}),
                                        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                                        ("responses", {"input": "hi", "max_output_tokens": 4})])
def test_a_body_naming_an_adapter_runs_every_prompt_under_it(kind, body):
    served = ServedModels(("demo", "alias"), ("sql",))
    for model, lora in (("sql", "sql"), ("alias", None)):
        raw = json.dumps({"model": model, **body}).encode()
        prepared = prepare_request(kind, raw, TOKENIZER, served, 64, RequestLimits())
        assert [p.lora for p in prepared.params] == [lora] * len(prepared.prompts)
    with pytest.raises(RequestError) as refused:
        prepare_request(kind, json.dumps({"model": "chat", **body}).encode(), TOKENIZER, served, 64, RequestLimits())
    assert (refused.value.status, refused.value.param) == (404, "model") and "`sql`" in str(refused.value)


@pytest.mark.parametrize("prefill, thinking", [(None, "optional"), ("<think>\n", "open"), ("<think>a</think>\n\n", "")])
def test_with_a_reasoning_parser_a_chat_constraint_holds_the_answer_after_the_thinking(prefill, thinking):
    """The thinking is free: opened by the prompt, optional, or none when the prompt closed it."""
    messages = [{"role": "user", "content": "hi"}]
    if prefill is not None:  # an assistant prefill continued (a template that opens the thinking ends the same)
        messages.append({"role": "assistant", "content": prefill})
    body = dict(messages=messages, continue_final_message=prefill is not None, add_generation_prompt=prefill is None)
    assert prepare("chat", parsers=ChatParsers("qwen3"), **body, **JSON).params[0].constraint.thinking == thinking
    assert prepare("chat", **body, **JSON).params[0].constraint.thinking == ""  # no parser: constrained at once
    completion = prepare("completion", parsers=ChatParsers("qwen3"), prompt="<think>", **JSON)
    assert completion.params[0].constraint.thinking == ""


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, parser, kept", [({"tools": [ADD]}, "mistral", True), ({}, "mistral", False),
                                                  ({"tools": [ADD], "tool_choice": "none"}, "mistral", False),
                                                  ({"tools": [ADD]}, "hermes", False),
                                                  ({"tools": [ADD]}, "granite", True),
                                                  ({"tools": [ADD]}, "glm45", True),
                                                  ({"tools": [ADD]}, "minimax_m2", True),
                                                  ({"tools": [ADD]}, "seed_oss", True)])
def test_a_chat_offering_tools_to_mistral_or_granite_keeps_special_tokens(fields, parser, kept):
    """vLLM's rule: `[TOOL_CALLS]` (and Granite's `<|tool_call|>`) is a special token, so the text
    must keep them to show a call."""
    prepared = prepare("chat", max_model_len=512, parsers=ChatParsers(tool_calls=parser),
                       messages=[{"role": "user", "content": "hi"}], **fields)
    assert prepared.params[0].skip_special_tokens is not kept


def test_gpt_oss_chats_keep_special_tokens_and_constrain_their_final_message():
    """Its channels are special tokens, and its constraint holds its final message, after any
    analysis; a completion is text as it is."""
    parsers, messages = ChatParsers("openai_gptoss"), [{"role": "user", "content": "hi"}]
    chat = prepare("chat", parsers=parsers, messages=messages, **JSON).params[0]
    assert not chat.skip_special_tokens and chat.constraint.thinking == "harmony"
    assert not prepare("chat", max_model_len=512, parsers=parsers, messages=messages,
                       tools=[ADD]).params[0].skip_special_tokens
    assert prepare("completion", parsers=parsers, prompt="hi").params[0].skip_special_tokens


@pytest.mark.parametrize("body, limits, status, param", [
    ({"model": "other", "prompt": "x"}, RequestLimits(), 404, "model"),
    ({"prompt": ["a", "b", "c"]}, RequestLimits(max_prompts=2), 400, "prompt"),
    ({"prompt": ["a", "b" * 80]}, RequestLimits(), 400, "prompt"),  # the second prompt fills the context
    ({"prompt": "a", "guided_regex": "x", "ignore_eos": True}, RequestLimits(), 400, "guided_regex"),
])
def test_bad_bodies_name_the_field(body, limits, status, param):
    with pytest.raises(RequestError) as refused:
        prepare("completion", limits, **body)
    assert (refused.value.status, refused.value.param) == (status, param)


def test_truncate_prompt_tokens_keeps_each_prompts_last_tokens():
    """vLLM's left truncation, after the chat template; -1 keeps what the context holds."""
    prepared = prepare("completion", prompt=["abcdef", [5, 6]], truncate_prompt_tokens=3, max_tokens=4)
    assert prepared.prompts == [list(b"def"), [5, 6]]
    messages = [{"role": "user", "content": "a long question"}]
    assert prepare("chat", messages=messages, truncate_prompt_tokens=5).prompts[0] == list(b"tant:")  # "...assistant:"
    whole = prepare("completion", prompt="y" * 40, truncate_prompt_tokens=-1, max_tokens=8)
    assert whole.prompts[0] == TOKENIZER.encode("y" * 40)


@pytest.mark.parametrize("value", [0, -2, 65])
def test_truncate_prompt_tokens_bounds(value):
    with pytest.raises(RequestError) as refused:
        prepare("completion", prompt="abc", truncate_prompt_tokens=value)
    assert (refused.value.status, refused.value.param) == (400, "truncate_prompt_tokens")


def test_a_responses_output_texts_logprobs_are_refused_where_chats_would_cover_other_tokens():
    asked = {"input": "x", "include": ["message.output_text.logprobs"], "max_output_tokens": 4}
    assert prepare("responses", **asked).params[0].logprobs == 0
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    assert prepare("responses", tools=[tool], tool_choice="none", **asked).params[0].logprobs == 0
    for refused in ({"tools": [tool]}, {"parsers": ChatParsers("qwen3")}):
        with pytest.raises(RequestError) as caught:
            prepare("responses", **asked, **refused)
        assert caught.value.param == "include"


TURNS = [item for n in range(6) for item in ({"role": "user", "content": f"question {n}?"},
                                             {"role": "assistant", "content": f"answer {n}."})]


def chat_prompt(messages: list[dict], max_model_len: int = 512) -> list[int]:
    return prepare("chat", max_model_len=max_model_len, messages=messages, max_tokens=4).prompts[0]


@pytest.mark.parametrize("limits, max_model_len", [(RequestLimits(), 80), (RequestLimits(max_chat_messages=5), 512)])
def test_truncation_auto_drops_the_fewest_first_turns_that_make_it_fit(limits, max_model_len):
    """Past the context length, or past the bound on a chat's messages: whole turns go from the
    start, the instructions stay; the request keeps every item (a stored response lists them)."""
    ask = {"instructions": "Be brief.", "input": TURNS + [{"role": "user", "content": "and now?"}],
           "max_output_tokens": 4}
    with pytest.raises(RequestError) as refused:
        prepare("responses", limits, max_model_len, **ask)
    assert refused.value.param in ("input", "max_output_tokens")
    prepared = prepare("responses", limits, max_model_len, truncation="auto", **ask)
    system = [{"role": "system", "content": "Be brief."}]
    kept = [k for k in range(0, len(TURNS) + 1, 2)
            if prepared.prompts[0] == chat_prompt(system + ask["input"][k:])]
    assert kept and kept[0] > 0 and len(prepared.responses.input) == len(ask["input"])
    with pytest.raises(RequestError):  # one turn more does not fit
        prepare("responses", limits, max_model_len, **{**ask, "input": ask["input"][kept[0] - 2:]})


def test_truncation_auto_refuses_what_even_its_last_turn_cannot_fit():
    long = {"input": TURNS + [{"role": "user", "content": "x" * 100}], "max_output_tokens": 4, "truncation": "auto"}
    with pytest.raises(RequestError) as refused:
        prepare("responses", max_model_len=64, **long)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "input", "context_length_exceeded")
