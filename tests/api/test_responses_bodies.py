"""A stored response's input items, made of the bodies the official `openai` client sends: OpenAI's
item shapes (validated by the client's `ResponseItemList`), each with an id, and a continuation
of them reads the same conversation the request did."""
from __future__ import annotations

from openai.types.responses import ResponseItem, ResponseItemList, ResponseOutputItem
from pydantic import TypeAdapter

from splitserve.api.request_models import parse_request
from splitserve.api.responses_bodies import function_call_item, input_items, message_item, read_back, reasoning_item
from splitserve.api.responses_request import ResponsesRequest
from tests.api.test_responses_request import ADD, sent_body

TURNS = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "2+3?"},
         {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
         {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2}'},
         {"type": "function_call_output", "call_id": "call_1", "output": "5"},
         {"role": "assistant", "content": "Five.", "phase": "final_answer"},
         {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "3+4?"}]}]


def test_input_items_are_openais_item_shapes_with_ids():
    request = parse_request(ResponsesRequest, sent_body(input=TURNS, tools=[ADD]))
    items = input_items(request)
    page = ResponseItemList.model_validate({"object": "list", "data": items, "first_id": items[0]["id"],
                                            "last_id": items[-1]["id"], "has_more": False})
    assert [item.type for item in page.data] == ["message", "message", "reasoning", "function_call",
                                                 "function_call_output", "message", "message"]
    assert items[2]["id"] == "rs_1" and len({item["id"] for item in items}) == len(items)
    assert items[5]["content"][0]["type"] == "output_text" and items[6]["content"][1]["text"] == "3+4?"
    assert items[5]["phase"] == "final_answer" and "phase" not in items[6]  # kept as the client sent it
    TypeAdapter(list[ResponseItem]).validate_python(items)


def test_a_continuation_of_the_items_reads_the_same_conversation_and_keeps_their_ids():
    request = parse_request(ResponsesRequest, sent_body(input=TURNS, tools=[ADD]))
    items = input_items(request)
    follow = parse_request(ResponsesRequest, sent_body(input="Thanks.", previous_response_id="resp_1"))
    continued = follow.continuing(items)
    assert continued.messages() == request.messages() + [{"role": "user", "content": "Thanks."}]
    assert input_items(continued)[:-1] == items


def test_an_output_read_back_reads_the_same_conversation_without_its_logprobs():
    logprobs = [{"token": "Five", "logprob": -0.25, "bytes": [70, 105, 118, 101], "top_logprobs": []}]
    output = [reasoning_item("rs_1", "add", "completed"), message_item("msg_1", "Five", "completed", logprobs),
              function_call_item("fc_1", "call_1", "add", '{"a": 2}', "completed")]
    back = read_back(output)
    TypeAdapter(list[ResponseOutputItem]).validate_python(back)
    assert back[1] == message_item("msg_1", "Five", "completed") and output[1]["content"][0]["logprobs"] == logprobs
    assert back[0] is output[0] and back[2] is output[2]
    follow = parse_request(ResponsesRequest, sent_body(input="Thanks.", previous_response_id="resp_1", tools=[ADD]))
    assert follow.continuing(back).messages() == follow.continuing(output).messages()
    assert read_back(back) is back  # none left to leave out: the same list
