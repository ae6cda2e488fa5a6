"""Structured output in a request: response_format, structured_outputs and guided_* become one
OutputConstraint; two options, or a malformed one, are refused naming the field."""
import json

import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest, parse_request
from splitserve.api.request_sampling import sampling_params
from tests.api.request_helpers import CHAT, COMPLETION


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
