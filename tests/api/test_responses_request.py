"""A `/v1/responses` request as the chat completion it asks for, built from the bodies the official
`openai` client sends (its `responses.create` through a transport that keeps the body)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from splitserve.api.errors import RequestError
from splitserve.api.request_models import parse_request
from splitserve.api.responses_request import ResponsesRequest, as_responses_error

ADD = {"type": "function", "name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "strict": True}


def sent_body(**create) -> bytes:
    """The body `client.responses.create(**create)` sends."""
    sent = []

    def keep(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(400, json={"error": {"message": "kept", "type": "invalid_request_error"}})

    client = openai.OpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(keep)))
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="demo", **create)
    return sent[0]


def chat_of(**create) -> dict:
    return parse_request(ResponsesRequest, sent_body(**create)).to_chat()


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    chat = chat_of(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert chat == {"model": "demo", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stream": False}


def test_a_cache_salt_and_a_priority_go_to_the_chat():
    chat = chat_of(input="Hi", extra_body={"cache_salt": "tenant-7", "priority": -3})
    assert (chat["cache_salt"], chat["priority"]) == ("tenant-7", -3)


def test_an_earlier_turn_sent_back_is_one_assistant_message_with_its_reasoning_and_calls():
    conversation = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "2 + 3"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add."}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    chat = chat_of(input=conversation, tools=[ADD], tool_choice={"type": "function", "name": "add"},
                   reasoning={"effort": "low"}, parallel_tool_calls=False)
    assert chat["messages"] == [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Adding.", "reasoning": "Add.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["reasoning_effort"] == "low" and chat["parallel_tool_calls"] is False


def earlier_output():
    """An earlier response's output as the client's own objects: a reasoning item, a final answer
    (OpenAI labels its `phase`), a call."""
    from openai.types.responses import (ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText,
                                        ResponseReasoningItem)
    from openai.types.responses.response_reasoning_item import Content
    return [ResponseReasoningItem(id="rs_1", type="reasoning", summary=[],
                                  content=[Content(type="reasoning_text", text="Add.")]),
            ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", phase="final_answer",
                                  content=[ResponseOutputText(type="output_text", text="Adding.", annotations=[],
                                                              logprobs=[])]),
            ResponseFunctionToolCall(id="fc_1", type="function_call", call_id="call_1", name="add",
                                     arguments='{"a": 2}', status="completed")]


@pytest.mark.parametrize("sent", ["objects", "dumped whole", "dumped without nulls"])
def test_an_earlier_output_sent_back_as_the_client_holds_it_is_taken(sent):
    """`input=previous.output + [...]`, or each item dumped (nulls and all: `phase`, and the
    hosted-tool fields `namespace`, `caller`, `async` of a call); `phase` changes nothing."""
    items = {"objects": earlier_output(),
             "dumped whole": [item.model_dump(by_alias=True) for item in earlier_output()],
             "dumped without nulls": [item.model_dump(by_alias=True, exclude_none=True) for item in earlier_output()]
             }[sent]
    turn = [{"role": "user", "content": "2 + 3?"}, *items, {"type": "function_call_output", "call_id": "call_1",
                                                            "output": "5"}]
    chat = chat_of(input=turn, tools=[ADD])
    assert chat["messages"][1] == {"role": "assistant", "content": "Adding.", "reasoning": "Add.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]}
    without_phase = [{**item, "phase": None} if item.get("type") == "message" else item
                     for item in [i if isinstance(i, dict) else i.model_dump(by_alias=True) for i in turn]]
    assert chat_of(input=without_phase, tools=[ADD]) == chat


@pytest.mark.parametrize("field, value", [("namespace", "billing"), ("async", True),
                                          ("caller", {"type": "program", "id": "x"})])
def test_a_hosted_tool_field_that_says_something_is_a_400_naming_it(field, value):
    call = {**earlier_output()[2].model_dump(by_alias=True, exclude_none=True), field: value}
    with pytest.raises(RequestError) as refused:
        parse_request(ResponsesRequest, sent_body(input=[{"role": "user", "content": "?"}, call], tools=[ADD]))
    assert refused.value.param == f"input.1.function_call.{field}" and "runs no tools itself" in refused.value.message


def test_text_format_is_chats_response_format():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = chat_of(input="x", text={"format": {"type": "json_schema", "name": "pt", "schema": schema, "strict": True}})
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "pt", "schema": schema, "strict": True}}
    assert chat_of(input="x", text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("create, param", [
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.message.content"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "extra_body": {"n": 2}}, "n"),
    ({"input": "x", "metadata": {f"k{n}": "v" for n in range(17)}}, "metadata"),
    ({"input": "x", "conversation": {"id": "conv_1", "name": "x"}}, "conversation"),
])
def test_what_this_server_cannot_honour_is_a_400_naming_the_field(create, param):
    with pytest.raises(RequestError) as refused:
        parse_request(ResponsesRequest, sent_body(**create))
    assert refused.value.param == param and refused.value.status == 400


def test_output_text_logprobs_ask_chats_logprobs():
    chat = chat_of(input="x", include=["message.output_text.logprobs"], top_logprobs=3)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)
    assert chat_of(input="x", include=["message.output_text.logprobs"])["top_logprobs"] == 0
    assert "logprobs" not in chat_of(input="x")
    with pytest.raises(RequestError) as refused:
        parse_request(ResponsesRequest, sent_body(input="x", top_logprobs=21))
    assert refused.value.param == "top_logprobs"


def test_a_refusal_of_the_chat_body_names_the_responses_field():
    error = as_responses_error(RequestError("max_completion_tokens: must be at least 1", param="max_completion_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens: must be at least 1")
    assert as_responses_error(RequestError("messages.3.content: too long", param="messages.3.content")).param == "input"
    assert as_responses_error(RequestError("x", param="tools.1.function.parameters")).param == "tools.1.parameters"
    schema = RequestError("x", param="response_format.json_schema.schema")
    assert as_responses_error(schema).param == "text.format.schema"


@pytest.mark.parametrize("conversation", ["conv_1", {"id": "conv_1"}])
def test_a_conversation_is_named_by_its_id_or_an_object_holding_it(conversation):
    assert parse_request(ResponsesRequest, sent_body(input="x", conversation=conversation)).conversation == "conv_1"
    assert parse_request(ResponsesRequest, sent_body(input="x")).conversation is None


def test_hints_that_ask_nothing_of_the_output_are_accepted():
    """What the client sends for OpenAI's caching, abuse monitoring and hosted tools."""
    chat = chat_of(input="x", prompt_cache_key="k", prompt_cache_retention="in_memory", safety_identifier="u",
                   max_tool_calls=3, stream=True, stream_options={"include_obfuscation": False})
    assert chat["messages"] == [{"role": "user", "content": "x"}] and chat["stream"] is True


def test_a_request_as_json_is_the_same_request_again():
    """What a replica runs again of a background response whose replica died: its request, the
    stored conversation it continued included, as JSON."""
    earlier = [item.model_dump(by_alias=True) for item in earlier_output()]
    ask = parse_request(ResponsesRequest, sent_body(
        input=[*earlier, {"type": "function_call_output", "call_id": "call_1", "output": "5"}], tools=[ADD],
        tool_choice={"type": "function", "name": "add"}, reasoning={"effort": "low"}, metadata={"k": "v"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}, top_logprobs=2,
        include=["message.output_text.logprobs"], conversation={"id": "conv_1"}, background=True,
        instructions="Be brief.", max_output_tokens=9, temperature=0.5))
    ask = ask.continuing([{"type": "message", "id": "msg_0", "role": "user", "status": "completed",
                           "content": [{"type": "input_text", "text": "2 + 3?"}]}])
    again = parse_request(ResponsesRequest, json.dumps(ask.model_dump(mode="json", by_alias=True,
                                                                      exclude_none=True)).encode())
    assert again == ask and again.to_chat() == ask.to_chat()


def test_allowed_tools_are_chats():
    chat = chat_of(input="x", tools=[ADD], tool_choice={"type": "allowed_tools", "mode": "required",
                                                        "tools": [{"type": "function", "name": "add"}]})
    assert chat["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
