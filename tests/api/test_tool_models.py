"""Tools in a chat request: the functions offered, the forced-call constraint of `tool_choice`,
and the refusals naming the field."""
import json

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.request_models import ChatCompletionRequest, parse_request
from splitserve.api.request_sampling import sampling_params
from tests.api.request_helpers import CHAT, chat


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
