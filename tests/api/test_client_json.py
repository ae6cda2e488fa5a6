"""JSON the server did not write: nesting past the recursion limit and lone surrogates are
`ValueError`s (a 400 for a body), where `json.loads` raised RecursionError or returned text no UTF-8
response can carry; surrogate pairs and ordinary JSON read as `json.loads` reads them."""
import json

import pytest

from splitserve.api import client_json
from splitserve.api.chat_template import messages_for_template
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest
from splitserve.api.tool_calls import parse_hermes_calls, parse_tool_calls

from tests.api.request_helpers import CHAT, COMPLETION, chat, refusal

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text", ['{"a": [1, 2.5, null, "\\ud83d\\ude00"]}', "[]", '"\\u00e9"'])
def test_ordinary_json_and_surrogate_pairs_read_as_json_loads(text):
    assert client_json.loads(text) == json.loads(text) == client_json.loads(text.encode())


@pytest.mark.parametrize("text, message", [(DEEP, "nested too deeply"), ('{"a": "\\ud800"}', "lone surrogate"),
                                           ('["\\udc00\\ud83d"]', "lone surrogate")])
def test_deep_nesting_and_lone_surrogates_are_value_errors(text, message):
    for raw in (text, text.encode()):
        with pytest.raises(ValueError, match=message):
            client_json.loads(raw)


@pytest.mark.parametrize("body", [DEEP.encode(), json.dumps({**COMPLETION, "prompt": "\ud800"}).encode(),
                                  json.dumps({**COMPLETION, "model": "\udfff"}).encode()])
def test_such_a_body_is_a_400(body):
    error = refusal(CompletionRequest, body)
    assert error.status == 400 and error.message.startswith("request body is not valid JSON: ")
    json.dumps(error.message, ensure_ascii=False).encode()  # the error body can be sent


def test_a_tool_call_argument_nested_too_deeply_is_refused_naming_it():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    request = chat(messages=[*CHAT["messages"], {"role": "assistant", "tool_calls": [call]}])
    with pytest.raises(RequestError) as refused:
        messages_for_template(request)
    assert refused.value.param == "messages.1.tool_calls.0.function.arguments"


def test_a_model_output_nested_too_deeply_is_text_not_a_call():
    assert parse_tool_calls(DEEP, {"f"}) is None
    assert parse_hermes_calls(f"<tool_call>{DEEP}</tool_call>", {"f"}) is None
