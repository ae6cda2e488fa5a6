"""The Conversations API's bodies: a new conversation's items (input items, a message's type left
out as clients do) and metadata, within OpenAI's bounds; items added, at least one and at most 20;
a metadata update that must say its metadata (null clears it); `include` only what items carry."""
from __future__ import annotations

import json

import pytest

from splitserve.api.conversation_requests import (
    MAX_ITEMS_ADDED,
    MetadataUpdate,
    NewConversation,
    NewItems,
    check_include,
)
from splitserve.api.errors import RequestError
from splitserve.api.request_models import parse_request
from splitserve.api.responses_bodies import stored_items

HI = {"role": "user", "content": "Hi"}


def test_a_new_conversations_items_are_input_items_kept_with_ids():
    body = parse_request(NewConversation, json.dumps({"items": [HI, {
        "type": "function_call_output", "call_id": "call_1", "output": "5"}], "metadata": {"k": "v"}}).encode())
    kept = stored_items(body.items)
    assert [item["type"] for item in kept] == ["message", "function_call_output"] and body.metadata == {"k": "v"}
    assert kept[0]["id"].startswith("msg_") and kept[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert parse_request(NewConversation, b"{}").items is None
    assert parse_request(MetadataUpdate, b'{"metadata": null}').metadata is None


@pytest.mark.parametrize("model, body, param", [
    (NewConversation, {"items": [HI] * (MAX_ITEMS_ADDED + 1)}, "items"),
    (NewConversation, {"metadata": {"k" * 65: "v"}}, "metadata"),
    (NewConversation, {"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "items.0.message.content"),
    (NewItems, {"items": []}, "items"),
    (NewItems, {"items": [HI], "extra": 1}, "extra"),
    (MetadataUpdate, {}, "metadata"),
])
def test_a_body_past_the_bounds_is_a_400_naming_the_field(model, body, param):
    with pytest.raises(RequestError) as refused:
        parse_request(model, json.dumps(body).encode())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_include_may_ask_only_for_what_items_carry():
    check_include(["message.output_text.logprobs"])
    check_include(None)
    with pytest.raises(RequestError) as refused:
        check_include(["message.output_text.logprobs", "reasoning.encrypted_content"])
    assert refused.value.param == "include"
