"""A `/v1/responses` answer from a choice's token deltas (a scripted run, no Ray), read by the
official `openai` client: its stream helper rebuilds the response from the events (and refuses
events out of order), which must equal the whole response built from the same choice."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from openai.types.responses import Response

from splitserve.api.responses_bodies import response_of_choice, status_of
from splitserve.api.responses_events import ResponseEvents
from splitserve.api.responses_request import ResponsesRequest
from splitserve.api.visible_text import TextStream
from splitserve.cluster import choices_response, large_bodies
from splitserve.cluster.choices_response import ChoicesResponse
from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.run_response import RunResponse
from splitserve.cluster.worker_loop import TokenDelta
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer
from tests.cluster.test_run_response import PROMPT, ScriptedRun, byte_ids, logprob_deltas

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
OUTPUTS = {
    "text": ("It is 5.", "stop", {}),
    "cut": ("It is", "length", {}),
    "reasoning": ("Sum it.</think>\n\nIt is 5.", "stop", {"thinking": True}),
    "empty reasoning": ("<think></think>\n\nIt is 5.", "stop", {"thinking": False}),  # no item, whole or streamed
    "call": ("Sum it.</think>\n\nOn it.\n" + CALL, "stop",
             {"thinking": True, "tool_names": frozenset({"add"}), "tool_parser": "hermes"}),
}


def reply(output: str, finish: str, options: dict, error: Exception | None = None) -> ChoicesResponse:
    """A chat choice of `output`, 3 bytes a delta; "stop" ends with EOS, "length" with its last byte."""
    ids = byte_ids(output) + ((ByteTokenizer.EOS,) if finish == "stop" else ())
    deltas = [TokenDelta(ids[i:i + 3], finish if i + 3 >= len(ids) else None, cached_tokens=0 if i == 0 else None)
              for i in range(0, len(ids), 3)]
    text = TextStream(ByteTokenizer(), SamplingParams(max_tokens=64), PROMPT)
    return ChoicesResponse([[RunResponse("chat", ScriptedRun(deltas, error), "demo", text, **options)]], 1)


def client_reading(body: bytes) -> openai.OpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    return openai.OpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def streamed(choice: ChoicesResponse, request: ResponsesRequest) -> bytes:
    async def collect():
        return b"".join([part async for part in choice.response_events(ResponseEvents(request, "resp_1", 7))])
    return asyncio.run(collect())


def whole(choice: ChoicesResponse, request: ResponsesRequest) -> dict:
    [body] = asyncio.run(choice.choices())
    return response_of_choice(request, "resp_1", 7, body, choice.usage)


def comparable(response: dict) -> dict:
    """Without the ids each build draws anew (items', calls'), what the client's stream helper adds
    (`parsed` text, `parsed_arguments`), and the blank a text before a call ends with (streamed
    before the call is seen, as chat streams it; the whole choice strips it)."""
    def part(content: dict) -> dict:
        return {k: v.strip() if k == "text" else v for k, v in content.items() if k != "parsed"}
    drawn = ("id", "call_id", "parsed_arguments")
    return {**response, "output": [{k: [part(c) for c in v] if k == "content" else v for k, v in item.items()
                                    if k not in drawn} for item in response["output"]]}


@pytest.mark.parametrize("name", OUTPUTS)
def test_the_stream_rebuilds_the_whole_response(name):
    output, finish, options = OUTPUTS[name]
    request = ResponsesRequest(model="demo", input="2 + 3?", tools=[{"type": "function", "name": "add"}])
    body = streamed(reply(output, finish, options), request)
    with client_reading(body).responses.stream(model="demo", input="2 + 3?") as stream:
        events = list(stream)  # the helper checks each event against the items it has seen
    final = events[-1].response  # the helper's own final response waits for response.completed only
    if finish == "stop":
        assert stream.get_final_response().output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{status_of(finish)}"
    want = whole(reply(output, finish, options), request)
    Response.model_validate(want)
    assert comparable(final.model_dump(exclude_unset=True)) == comparable(want)
    assert final.usage.output_tokens == len(byte_ids(output)) + (finish == "stop")


def test_each_kind_of_output_is_its_item():
    request = ResponsesRequest(model="demo", input="2 + 3?", tools=[{"type": "function", "name": "add"}])
    items = whole(reply(*OUTPUTS["call"]), request)["output"]
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Sum it."}]
    assert items[1]["content"][0]["text"] == "On it." and items[1]["status"] == "completed"
    assert (items[2]["name"], json.loads(items[2]["arguments"])) == ("add", {"a": 2})
    cut = whole(reply(*OUTPUTS["cut"]), request)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    usage = whole(reply(*OUTPUTS["reasoning"]), request)["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == len("Sum it.")


def test_the_output_texts_logprobs_are_chats_whole_and_streamed_with_their_text():
    """Stop string "END": the text after it never comes (the logprobs of the tokens through it do,
    as chat's); the tokens held while "E" might start it bring theirs with the text that follows,
    and those of the stop string's, which no text follows, come with the text's done event."""
    request = ResponsesRequest(model="demo", input="x", include=["message.output_text.logprobs"], top_logprobs=2)
    params = SamplingParams(max_tokens=64, stop=["END"], logprobs=2)

    def choice() -> ChoicesResponse:
        text = TextStream(ByteTokenizer(), params, PROMPT)
        run = ScriptedRun(logprob_deltas("Hi Eve END no", 2), params=params)
        return ChoicesResponse([[RunResponse("chat", run, "demo", text, num_top=2)]], 1)

    [chat] = asyncio.run(choice().choices())
    got = whole(choice(), request)
    [text] = got["output"][0]["content"]
    assert text["text"] == "Hi Eve " and text["logprobs"] == chat["logprobs"]["content"]
    assert [entry["token"] for entry in text["logprobs"]] == list("Hi Eve END")
    assert all(len(entry["top_logprobs"]) == 2 for entry in text["logprobs"])
    body = streamed(choice(), request)
    events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for e in deltas for lp in e["logprobs"]] == text["logprobs"][:-2]  # "N", "D" bring no text
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == text["logprobs"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output[0].content[0].model_dump()["logprobs"] == text["logprobs"]


def test_the_events_holding_a_long_texts_logprobs_are_encoded_off_the_loop(monkeypatch):
    """Each of the last four events carries every logprob of the text: past the threshold, each is
    encoded in pieces in a thread; the deltas (16 tokens each) stay on the loop."""
    request = ResponsesRequest(model="demo", input="x", include=["message.output_text.logprobs"], top_logprobs=2)
    tokens = large_bodies.LOGPROB_TOKENS_ON_LOOP + 1
    params = SamplingParams(max_tokens=tokens, logprobs=2)
    run = ScriptedRun(logprob_deltas("".join(chr(97 + i % 26) for i in range(tokens)), 16), params=params)
    choice = ChoicesResponse([[RunResponse("chat", run, "demo", TextStream(ByteTokenizer(), params, PROMPT),
                                           num_top=2)]], 1)
    encode, off_loop = choices_response.sse_event, []

    def recorded(event: dict, in_pieces: bool = False) -> bytes:
        if in_pieces and threading.current_thread() is not threading.main_thread():
            off_loop.append(event["type"])
        return encode(event, in_pieces)

    monkeypatch.setattr(choices_response, "sse_event", recorded)
    events = [json.loads(line[6:]) for line in streamed(choice, request).decode().split("\n")
              if line.startswith("data: ")]
    assert off_loop == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"]  # the run ends at its length
    assert len(events[-1]["response"]["output"][0]["content"][0]["logprobs"]) == tokens


def test_a_failed_choice_ends_the_stream_with_an_error_and_the_response_failed():
    request = ResponsesRequest(model="demo", input="x")
    body = streamed(reply("It is", None, {}, RequestFailed("request failed after 3 attempts")), request)
    events = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "after 3 attempts" in events[-2]["message"]
    assert Response.model_validate(events[-1]["response"]).status == "failed"
