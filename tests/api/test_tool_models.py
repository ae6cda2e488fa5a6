"""Tools in a chat request: the functions offered, the forced-call constraint of `tool_choice`,
`allowed_tools` (every tool in the prompt, only those allowed callable), and the refusals naming
the field."""
import json

import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.choice_text import choice_options
from splitserve.api.errors import RequestError
from splitserve.api.request_models import parse_request
from splitserve.api.request_sampling import sampling_params
from splitserve.engine.demo import demo_tokenizer
from tests.api.request_helpers import CHAT, chat, refusal


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


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_keep_every_tool_in_the_prompt_and_only_those_allowed_callable():
    required = chat(tools=[TOOL, ADD], tool_choice=allowed("required", "add"))
    assert [f["name"] for f in required.tool_functions()] == ["weather", "add"]  # the prompt stays the same
    assert [f["name"] for f in required.callable_functions()] == ["add"]
    forced, field = required.output_constraint()
    assert field == "tool_choice" and json.loads(forced.spec)["properties"]["name"] == {"const": "add"}
    auto = chat(tools=[TOOL, ADD], tool_choice=allowed("auto", "weather"))
    assert auto.output_constraint()[0] is None and [f["name"] for f in auto.callable_functions()] == ["weather"]
    assert set(choice_options(auto, 0, [1, 2], demo_tokenizer())["tool_names"]) == {"weather"}  # a call of add: text


@pytest.mark.parametrize("tool_choice, message", [
    ("bogus", "tool_choice: Input should be 'none', 'auto' or 'required'"),
    ({"type": "function", "function": {}}, "tool_choice.function.name: Field required"),
    ({"type": "function", "function": {"name": "weather"}, "x": 1}, "tool_choice.x: unsupported parameter"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {}}]}},
     "tool_choice.allowed_tools.tools.0.function.name: Field required"),
])
def test_a_malformed_tool_choice_is_refused_naming_the_branch_the_client_meant(tool_choice, message):
    """tool_choice is a string or one of two objects: the error is the one in what the client sent."""
    error = refusal(ChatCompletionRequest, {**CHAT, "tools": [TOOL], "tool_choice": tool_choice})
    assert (error.message, error.param, error.status) == (message, message.split(":")[0], 400)


@pytest.mark.parametrize("fields, needle", [
    ({"tools": [TOOL], "tool_choice": allowed("auto", "weather", "other")}, "no tool is named"),
    ({"tools": [TOOL], "tool_choice": allowed("sometimes", "weather")}, "auto"),
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
