"""The conversation store: a conversation's items in order, pages of them as OpenAI lists them,
one item read or deleted, its metadata replaced; an output's logprobs listed only when asked, and
never read by a response; an item id appears once; a 404 naming the field for a conversation or
item it does not hold; bounded by count and bytes, least recently used first, and a conversation
that alone would pass the bytes refused; the response store's actor answers its calls
(`conversation`), and only those."""
from __future__ import annotations

import json

import pytest

from splitserve.api.conversation_store import ConversationStore
from splitserve.api.errors import RequestError
from splitserve.api.response_store import ResponseStore
from tests.api.test_response_store import items, response, with_logprobs


def message(item_id: str, text: str = "hi") -> dict:
    return {"type": "message", "id": item_id, "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def test_a_conversation_keeps_its_items_in_order_and_lists_them_in_pages():
    store = ConversationStore(10, 1 << 20)
    conversation = store.create({"topic": "sums"}, [message("msg_1"), message("msg_2")])
    assert conversation["object"] == "conversation" and conversation["id"].startswith("conv_")
    assert conversation["metadata"] == {"topic": "sums"} and store.get(conversation["id"]) == conversation
    added = store.add(conversation["id"], [message("msg_3"), message("msg_4")])
    assert added == {"object": "list", "data": [message("msg_3"), message("msg_4")], "first_id": "msg_3",
                     "last_id": "msg_4", "has_more": False}
    cid = conversation["id"]
    assert store.context(cid) == [message(f"msg_{n}") for n in (1, 2, 3, 4)]
    newest = store.items(cid, limit=3)  # OpenAI's default order: newest first
    assert [i["id"] for i in newest["data"]] == ["msg_4", "msg_3", "msg_2"] and newest["has_more"]
    rest = store.items(cid, limit=3, after=newest["last_id"])
    assert [i["id"] for i in rest["data"]] == ["msg_1"] and not rest["has_more"]
    assert [i["id"] for i in store.items(cid, order="asc")["data"]] == ["msg_1", "msg_2", "msg_3", "msg_4"]
    assert store.item(cid, "msg_3") == message("msg_3")
    assert store.delete_item(cid, "msg_2") == conversation
    assert [i["id"] for i in store.context(cid)] == ["msg_1", "msg_3", "msg_4"]
    assert store.update(cid, {"topic": "products"})["metadata"] == {"topic": "products"}
    assert store.delete(cid) == {"id": cid, "object": "conversation.deleted", "deleted": True}
    assert len(store) == 0 and store.bytes == 0


@pytest.mark.parametrize("call, param", [
    (lambda store, cid: store.get("conv_none"), "conversation_id"),
    (lambda store, cid: store.add("conv_none", [message("msg_9")]), "conversation_id"),
    (lambda store, cid: store.delete("conv_none"), "conversation_id"),
    (lambda store, cid: store.context("conv_none"), "conversation"),
    (lambda store, cid: store.item(cid, "msg_none"), "item_id"),
    (lambda store, cid: store.delete_item(cid, "msg_none"), "item_id"),
])
def test_what_it_does_not_hold_is_a_404_naming_the_field(call, param):
    store = ConversationStore(10, 1 << 20)
    cid = store.create({}, [message("msg_1")])["id"]
    with pytest.raises(RequestError) as missing:
        call(store, cid)
    assert (missing.value.status, missing.value.param) == (404, param)


def test_an_item_id_appears_once_in_a_conversation():
    store = ConversationStore(10, 1 << 20)
    with pytest.raises(RequestError, match="msg_1"):
        store.create({}, [message("msg_1"), message("msg_1")])
    assert len(store) == 0
    cid = store.create({}, [message("msg_1")])["id"]
    with pytest.raises(RequestError) as again:
        store.add(cid, [message("msg_2"), message("msg_1")])
    assert again.value.param == "items" and [i["id"] for i in store.context(cid)] == ["msg_1"]


def test_past_its_count_or_bytes_the_least_recently_used_go_first():
    store = ConversationStore(2, 1 << 20)
    first, second = store.create({}, []), store.create({}, [])
    store.get(first["id"])  # used: the second is the oldest now
    third = store.create({}, [])
    assert [c["id"] for c in (first, third)] == [store.get(c["id"])["id"] for c in (first, third)]
    with pytest.raises(RequestError):
        store.get(second["id"])
    size = len(json.dumps(first)) + len(json.dumps(items("x" * 100)))
    by_bytes = ConversationStore(10, 2 * size + 10)
    kept = [by_bytes.create({}, items("x" * 100))["id"] for _ in range(3)]
    assert len(by_bytes) == 2 and by_bytes.bytes <= 2 * size + 10
    assert by_bytes.context(kept[2]) and by_bytes.context(kept[1])


def test_a_conversation_that_alone_would_pass_the_bytes_is_refused_and_left_as_it_was():
    store = ConversationStore(10, 2000)
    cid = store.create({}, [message("msg_1")])["id"]
    with pytest.raises(RequestError) as refused:
        store.add(cid, [message("msg_2", "x" * 3000)])
    assert refused.value.status == 400 and refused.value.param == "items"
    assert [i["id"] for i in store.context(cid)] == ["msg_1"] and len(store) == 1


def test_an_outputs_logprobs_are_kept_and_listed_only_when_asked_and_never_read_by_a_response():
    store = ConversationStore(10, 1 << 20)
    cid = store.create({}, [message("msg_1")])["id"]
    said, plain = with_logprobs("resp_a", "five")["output"], response("resp_a", "five")["output"]
    store.add(cid, said)
    assert store.context(cid) == [message("msg_1")] + plain
    assert store.items(cid)["data"] == plain + [message("msg_1")] and store.item(cid, "msg_resp_a") == plain[0]
    assert store.items(cid, logprobs=True)["data"] == said + [message("msg_1")]
    assert store.item(cid, "msg_resp_a", logprobs=True) == said[0]


def test_a_store_sized_0_keeps_none():
    with pytest.raises(RequestError, match="stored_conversations is 0"):
        ConversationStore(0, 0).create({}, [])


def test_the_response_stores_actor_answers_its_calls_and_only_those():
    store = ResponseStore(10, 1 << 20, conversations=ConversationStore(10, 1 << 20))
    cid = store.conversation("create", {}, [message("msg_1")])["id"]
    assert store.conversation("context", cid) == [message("msg_1")]
    with pytest.raises(ValueError):
        store.conversation("_put", {"id": "conv_x"}, [], "items")
    with pytest.raises(RequestError):  # a store made without conversations keeps none
        ResponseStore(10, 1 << 20).conversation("create", {}, [])
