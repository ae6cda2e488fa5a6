"""OpenAI's Responses API (`/v1/responses`) through a real local cluster, with the official `openai`
client: a response is the chat completion it asks for (text, status, usage), streamed as events the
client's stream helper accepts; a forced function call comes back as a `function_call` item, and
its output sent back in `input` continues the conversation; `text.format` holds the output to a
schema; what this server cannot honour is a 400 naming the field. Stored responses: retrieved,
continued by `previous_response_id` as the chat of the whole conversation (the earlier output's
text, not its logprobs), their input items listed in pages, deleted; a streamed one kept; `store:
false` keeps none; a background one polled to the foreground's answer, and one cancelled stops
running; a background stream outlives its client and is streamed again from any event."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

ADD = {"type": "function", "name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}
ASK = "What is 2 + 3?"


def test_a_response_is_the_chat_completion_it_asks_for(client):
    chat = client.chat.completions.create(model="demo", max_completion_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    got = client.responses.create(model="demo", instructions="Be brief.", input=ASK, max_output_tokens=12,
                                  temperature=0)
    [choice] = chat.choices
    assert got.output_text == choice.message.content and got.id.startswith("resp_")
    assert got.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(model="demo", instructions="Be brief.", input=ASK, max_output_tokens=12,
                                          temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{got.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    assert events[-1].response.usage.output_tokens == got.usage.output_tokens


def test_the_output_texts_logprobs_are_the_chat_completions(client):
    chat = client.chat.completions.create(model="demo", max_completion_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "system", "content": "Be terse."},
                                                                    {"role": "user", "content": "Is 2 + 3 five?"}])
    got = client.responses.create(model="demo", instructions="Be terse.", input="Is 2 + 3 five?", max_output_tokens=8,
                                  temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)
    [text] = got.output[0].content
    expected = chat.choices[0].logprobs.content
    assert [t.token for t in text.logprobs] == [t.token for t in expected] and len(expected) == 8
    assert [t.logprob for t in text.logprobs] == pytest.approx([t.logprob for t in expected], abs=1e-4)
    assert [[a.token for a in t.top_logprobs] for t in text.logprobs] == [
        [a.token for a in t.top_logprobs] for t in expected]


def test_a_forced_call_streamed_then_its_output_sent_back(client):
    args = dict(model="demo", tools=[ADD], tool_choice={"type": "function", "name": "add"}, max_output_tokens=120)
    with client.responses.stream(input=ASK, **args) as stream:
        final = stream.get_final_response()  # the helper rebuilds it from the events, in order
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_") and final.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    turn = [{"role": "user", "content": ASK}, {"type": "function_call", "call_id": call.call_id, "name": "add",
                                               "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    answer = client.responses.create(model="demo", input=turn, tools=[ADD], max_output_tokens=8, temperature=0)
    assert answer.usage.input_tokens > final.usage.input_tokens  # the call and its output are in the prompt


def test_allowed_tools_call_only_those_named(client):
    weather = {"type": "function", "name": "weather", "description": "The weather in a city now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                              "required": ["city"], "additionalProperties": False}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "weather"}]}
    got = client.responses.create(model="demo", input=ASK, tools=[ADD, weather], tool_choice=choice,
                                  max_output_tokens=120)
    [call] = [item for item in got.output if item.type == "function_call"]
    assert call.name == "weather" and got.tool_choice.type == "allowed_tools" and got.tool_choice.mode == "required"


def test_text_format_holds_the_output_to_its_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"enum": ["yes", "no"]}}}
    got = client.responses.create(model="demo", input="Is 2 + 3 five?", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(got.output_text), schema)


def test_a_stored_response_is_retrieved_continued_listed_and_deleted(client):
    first = client.responses.create(model="demo", instructions="Be terse.", input="Is 2 + 3 five?",
                                    max_output_tokens=8, temperature=0, include=["message.output_text.logprobs"])
    assert first.store and client.responses.retrieve(first.id) == first and first.output_text
    assert len(first.output[0].content[0].logprobs) == first.usage.output_tokens  # kept, and retrieved, whole
    follow = client.responses.create(model="demo", previous_response_id=first.id, input="And 3 + 4?",
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="demo", max_completion_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Is 2 + 3 five?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And 3 + 4?"}])  # the instructions do not carry over, as OpenAI's do not
    assert follow.output_text == chat.choices[0].message.content and follow.previous_response_id == first.id
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    items = list(client.responses.input_items.list(follow.id, order="asc", limit=1))  # the client walks the pages
    assert [item.type for item in items] == ["message"] * 3 and items[1].id == first.output[0].id
    assert [item.content[0].text for item in items] == ["Is 2 + 3 five?", first.output_text, "And 3 + 4?"]
    assert items[1].content[0].logprobs == []  # the follow read the text
    with pytest.raises(openai.BadRequestError) as refused:  # the store's refusal, across its actor
        client.responses.input_items.list(follow.id, limit=0)
    assert refused.value.param == "limit"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="demo", previous_response_id=first.id, input="?", max_output_tokens=2)
    assert missing.value.param == "previous_response_id"
    again = client.responses.create(model="demo", previous_response_id=follow.id, input="Ok.", max_output_tokens=2)
    assert again.usage.input_tokens > follow.usage.input_tokens  # follow kept its own copy of the conversation


def test_a_streamed_response_is_kept_and_store_false_keeps_none(client):
    events = list(client.responses.create(model="demo", input=ASK, max_output_tokens=6, temperature=0, stream=True))
    assert client.responses.retrieve(events[-1].response.id) == events[-1].response
    unkept = client.responses.create(model="demo", input=ASK, max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_background_response_is_polled_and_a_cancelled_one_stops(client, server):
    ask = dict(model="demo", instructions="Be terse.", input="Is 2 + 3 five?", temperature=0)
    fore = client.responses.create(max_output_tokens=8, **ask)
    back = client.responses.create(max_output_tokens=8, background=True, **ask)
    assert (back.status, back.background, back.output) == ("in_progress", True, [])
    done = polled(client, back.id)
    assert (done.status, done.output_text, done.usage.output_tokens) == (fore.status, fore.output_text, 8)
    long = client.responses.create(max_output_tokens=1900, background=True, **ask)
    cancelled = when_workers(server, busy=True)
    assert client.responses.cancel(long.id).status == "cancelled"
    stopped = when_workers(server, busy=False) - cancelled  # its runs stopped
    started = time.monotonic()
    client.responses.create(max_output_tokens=1900, **ask)  # what it would have taken
    assert stopped < (time.monotonic() - started) / 2
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(fore.id)  # not a background response
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(max_output_tokens=2, background=True, store=False, **ask)
    assert caught.value.param == "background"


def test_a_background_stream_goes_on_without_its_client_and_is_read_again_from_any_event(client, server):
    """The client reads a few events of a background stream and goes away; the response runs to
    its end, and `retrieve(stream=True, starting_after=n)` streams the rest, which with the first
    few are the foreground stream's events (same order and text); from the start, all of them."""
    ask = dict(model="demo", instructions="Be terse.", input="Is 2 + 3 five?", max_output_tokens=48, temperature=0)
    fore = list(client.responses.create(stream=True, **ask))
    stream = client.responses.create(stream=True, background=True, **ask)
    first = [event for _, event in zip(range(5), stream)]
    stream.close()
    response_id = first[0].response.id
    assert first[0].response.background and first[0].response.status == "in_progress"
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(fore)))
    assert [e.type for e in events] == [e.type for e in fore]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "".join(e.delta for e in fore if e.type == "response.output_text.delta")
    ended = client.responses.retrieve(response_id)
    assert (ended.status, ended.usage.output_tokens, ended.output_text) == \
        (fore[-1].response.status, 48, fore[-1].response.output_text)
    again = list(client.responses.retrieve(response_id, stream=True))  # after it ended: every event
    assert [e.sequence_number for e in again] == list(range(len(fore))) and again[-1].response == ended
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(fore[-1].response.id, stream=True)  # not a background stream
    assert refused.value.param == "stream"


def polled(client, response_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status == "in_progress":
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
    return response


def when_workers(server: str, busy: bool, timeout_s: float = 60) -> float:
    """When the workers' load reports (every 50 ms) first show a request decoding (`busy`), or
    nothing decoding or waiting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{server}/v1/cluster/status").json()["workers"].values()
        if busy == any(w["num_decoding"] or w["num_waiting"] or w["pending_prompt_tokens"] for w in workers):
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"the workers never became {'busy' if busy else 'idle'}")


@pytest.mark.parametrize("create, param", [
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.message.content"),
])
def test_what_this_server_cannot_honour_is_a_400_naming_the_field(client, create, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "demo", "input": ASK, **create})
    assert refused.value.param == param
