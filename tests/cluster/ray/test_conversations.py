"""OpenAI's Conversations API (`/v1/conversations`) through a real local cluster, with the official
`openai` client: a conversation is created with items and metadata; a response created in it reads
its items before its input (the same answer as the chat of the whole conversation) and adds its
input and output to it, streamed or not; its items are listed in pages (the client walks them; an
output's logprobs when `include` asks), read and deleted one by one; its metadata replaced; once
deleted it is a 404, for a response too. What it refuses is a 4xx naming the field. One grown past
the bounds on a chat (the `hardening` app's 8 messages) is read by `truncation: "auto"` from its
latest turns."""
from __future__ import annotations

import openai
import pytest

ASK = "Is 2 + 3 five?"
LOGPROBS = "message.output_text.logprobs"


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    chat = client.chat.completions.create(model="demo", max_completion_tokens=max_tokens, temperature=0,
                                          messages=messages)
    return chat.choices[0].message.content, chat.usage.prompt_tokens


def test_a_conversation_is_extended_by_its_responses_listed_and_deleted(client):
    conversation = client.conversations.create(items=[{"type": "message", "role": "system", "content": "Be terse."}],
                                               metadata={"topic": "sums"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "sums"}
    first = client.responses.create(model="demo", conversation=conversation.id, input=ASK, max_output_tokens=8,
                                    temperature=0, store=False, include=[LOGPROBS])
    said = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": ASK}]
    assert (first.output_text, first.usage.input_tokens) == chat_text(client, said, 8) and first.output_text
    assert first.conversation.id == conversation.id
    events = list(client.responses.create(model="demo", conversation={"id": conversation.id}, input="And 3 + 4?",
                                          max_output_tokens=6, temperature=0, stream=True))
    second = events[-1].response
    said += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And 3 + 4?"}]
    assert (second.output_text, second.usage.input_tokens) == chat_text(client, said, 6)
    items = list(client.conversations.items.list(conversation.id, order="asc", limit=2))  # the client walks pages
    assert [item.content[0].text for item in items] == ["Be terse.", ASK, first.output_text, "And 3 + 4?"] + [
        item.content[0].text for item in second.output]  # none when the model said nothing
    assert items[2].id == first.output[0].id and [item.id for item in items[4:]] == [i.id for i in second.output]
    assert client.conversations.items.retrieve(items[1].id, conversation_id=conversation.id) == items[1]
    assert items[2].content[0].logprobs == []  # kept, listed when asked:
    assert client.conversations.items.retrieve(items[2].id, conversation_id=conversation.id, include=[LOGPROBS]
                                               ).content[0].logprobs == first.output[0].content[0].logprobs
    listed = client.conversations.items.list(conversation.id, include=[LOGPROBS], order="asc")
    assert listed.data[2].content[0].logprobs == first.output[0].content[0].logprobs
    assert client.conversations.items.delete(items[1].id, conversation_id=conversation.id).id == conversation.id
    assert [item.id for item in client.conversations.items.list(conversation.id)] == [
        item.id for item in items[::-1] if item.id != items[1].id]
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Thanks."}])
    assert [item.content[0].text for item in added.data] == ["Thanks."] and added.first_id == added.last_id
    updated = client.conversations.update(conversation.id, metadata={"topic": "more sums"})
    assert updated.metadata == {"topic": "more sums"} and client.conversations.retrieve(conversation.id) == updated
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="demo", conversation=conversation.id, input="?", max_output_tokens=2)
    assert missing.value.param == "conversation"


def test_what_a_conversation_refuses_is_a_4xx_naming_the_field(client):
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": ASK}])
    [item] = client.conversations.items.list(conversation.id).data
    refusals = [
        (lambda: client.conversations.create(items=[{"role": "user", "content": "x"}] * 21), "items"),
        (lambda: client.conversations.create(metadata={f"k{n}": "v" for n in range(17)}), "metadata"),
        (lambda: client.conversations.items.create(conversation.id, items=[
            {"type": "message", "id": item.id, "role": "user", "content": "again"}]), "items"),
        (lambda: client.conversations.items.list(conversation.id, include=["file_search_call.results"]), "include"),
        (lambda: client.responses.create(model="demo", conversation=conversation.id, previous_response_id="resp_x",
                                         input="?", max_output_tokens=2), "conversation"),
    ]
    for call, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == param
    with pytest.raises(openai.NotFoundError) as missing:
        client.conversations.items.retrieve("msg_none", conversation_id=conversation.id)
    assert missing.value.param == "item_id"


def test_truncation_auto_reads_a_conversation_past_the_bounds_from_its_latest_turns(hardening_server):
    client = openai.OpenAI(base_url=f"{hardening_server}/v1", api_key="unused", max_retries=0, timeout=120)
    turns = [{"role": role, "content": f"{role} turn {n}"} for n in range(5) for role in ("user", "assistant")]
    conversation = client.conversations.create(items=turns)
    ask = dict(model="demo", conversation=conversation.id, input="And now?", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:  # 11 messages, past the app's 8
        client.responses.create(**ask)
    assert refused.value.param == "input"
    fitted = client.responses.create(**ask, truncation="auto")
    latest = turns[4:] + [{"role": "user", "content": "And now?"}]  # 7 messages: 8 would start with an answer
    chat = client.chat.completions.create(model="demo", messages=latest, max_completion_tokens=4, temperature=0)
    assert fitted.truncation == "auto" and fitted.usage.input_tokens == chat.usage.prompt_tokens
    assert fitted.output_text == (chat.choices[0].message.content or "")
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == 11 + len(fitted.output)
