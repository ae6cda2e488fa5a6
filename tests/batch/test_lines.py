"""Batch input validation (every problem reported with its line) and result lines."""
from __future__ import annotations

import json

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.lazy_grammar import LazyGrammar
from splitserve.api.limits import RequestLimits
from splitserve.batch.lines import BatchLine, InputFileError, LineRules, parse_input, prepare
from splitserve.engine.demo import demo_tokenizer
from tests.batch.batch_helpers import as_jsonl, batch_lines

HIDDEN_SIZE = 64


def rules(max_model_len: int = 2048, **options) -> LineRules:
    return LineRules(demo_tokenizer(), "demo", max_model_len, HIDDEN_SIZE, **options)


def test_valid_lines_parse_with_their_kind():
    lines = parse_input(as_jsonl(batch_lines(3)) + b"\n")
    assert [(x.line, x.custom_id, x.kind) for x in lines] == [(1, "req-0", "completion"), (2, "req-1", "completion"),
                                                              (3, "req-2", "completion")]


@pytest.mark.parametrize("line, needle, param", [
    ("{not json", "not valid JSON", None),
    ("[1]", "JSON object", None),
    ('{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}', "custom_id", "custom_id"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "method", "method"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/moderations", "body": {}}', "url", "url"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": 3}', "body", "body"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}', "stream",
     "body.stream"),
])
def test_invalid_lines_are_reported_with_line_and_param(line, needle, param):
    data = as_jsonl(batch_lines(1)) + line.encode() + b"\n"
    with pytest.raises(InputFileError) as caught:
        parse_input(data)
    [error] = caught.value.errors
    assert error["line"] == 2 and needle in error["message"] and error["param"] == param


def test_lines_end_at_newlines_alone_and_a_byte_order_mark_is_not_text():
    """JSON Lines: U+2028, U+2029 and U+0085 are text inside a JSON string (`ensure_ascii=False`
    writes them raw), which str.splitlines took for line ends; CRLF ends are fine."""
    lines = batch_lines(3)
    lines[1]["body"]["prompt"] = "one\u2028two\u2029three\x85four"
    data = "".join(json.dumps(line, ensure_ascii=False) + "\r\n" for line in lines).encode()
    parsed = parse_input(b"\xef\xbb\xbf" + data)
    assert [x.custom_id for x in parsed] == ["req-0", "req-1", "req-2"] and [x.line for x in parsed] == [1, 2, 3]
    assert parsed[1].body["prompt"] == lines[1]["body"]["prompt"]


def test_duplicate_custom_ids_empty_files_and_endpoint_mismatch():
    lines = batch_lines(2)
    lines[1]["custom_id"] = "req-0"
    with pytest.raises(InputFileError, match="unique"):
        parse_input(as_jsonl(lines))
    with pytest.raises(InputFileError, match="no requests"):
        parse_input(b"\n\n")
    with pytest.raises(InputFileError, match="differs from the batch's endpoint"):
        parse_input(as_jsonl(batch_lines(1)), "/v1/chat/completions")


def test_prepare_checks_a_body_like_its_endpoint():
    [line] = parse_input(as_jsonl(batch_lines(1)))
    prepared = prepare(line, rules())
    assert prepared.params[0].max_tokens == 16 and prepared.prompts[0][1:] == list(line.body["prompt"].encode())
    [bad] = parse_input(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "demo", "messages": [], "top_p": 7}}).encode())
    with pytest.raises(RequestError) as caught:
        prepare(bad, rules())
    assert caught.value.status == 400


def test_a_line_naming_no_priority_runs_at_the_batchs():
    plain, own = parse_input(as_jsonl([batch_lines(1)[0], {**batch_lines(2)[1], "body": {
        **batch_lines(2)[1]["body"], "priority": -2}}]))
    limits = RequestLimits(priorities=True)
    assert [prepare(plain, rules(limits=limits, priority=3)).params[0].priority,
            prepare(own, rules(limits=limits, priority=3)).params[0].priority,
            prepare(plain, rules(limits=limits)).params[0].priority] == [3, -2, 0]


def test_a_responses_line_is_prepared_as_the_chat_it_asks_for():
    """Its prompt is the chat's of the same messages; a refusal names the Responses field; it
    continues no stored response and runs in no background (a batch keeps no responses)."""
    def line(url: str, **body) -> dict:
        return {"custom_id": url, "method": "POST", "url": url, "body": {"model": "demo", **body}}

    asked, chat = parse_input(as_jsonl([
        line("/v1/responses", instructions="Be terse.", input="Hi?", max_output_tokens=5),
        line("/v1/chat/completions", messages=[{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": "Hi?"}], max_completion_tokens=5)]))
    assert (asked.kind, asked.runs_as, chat.runs_as) == ("responses", "chat", "chat")
    prepared, expected = (prepare(x, rules()) for x in (asked, chat))
    assert prepared.prompts == expected.prompts and prepared.params[0].max_tokens == 5
    assert prepared.responses.instructions == "Be terse." and expected.responses is None
    [bad] = parse_input(as_jsonl([line("/v1/responses", input="x", text={"format": {"type": "json_schema"}})]))
    with pytest.raises(RequestError) as caught:
        prepare(bad, rules())
    assert caught.value.status == 400 and caught.value.param.startswith("text.format")
    for param, value in (("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("background", True)):
        [kept] = parse_input(as_jsonl([line("/v1/responses", input="x", **{param: value})]))
        with pytest.raises(RequestError) as caught:
            prepare(kept, rules())
        assert caught.value.param == param


def test_prepare_takes_every_option_of_the_endpoint_and_compiles_constraints_up_front():
    [line] = parse_input(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {
        "model": "demo", "prompt": "hi", "n": 2, "best_of": 3, "logprobs": 2, "echo": True}}).encode())
    prepared = prepare(line, rules())
    assert prepared.request.num_choices() == (3, 2) and prepared.params[0].prompt_logprobs == 2
    [bad] = parse_input(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "demo", "prompt": "hi", "guided_regex": "[a-"}}).encode())
    grammar = LazyGrammar(demo_tokenizer(), demo_tokenizer().vocab_size)
    with pytest.raises(RequestError) as caught:
        prepare(bad, rules(check_constraint=grammar.check))
    assert (caught.value.status, caught.value.param) == (400, "guided_regex")


def test_an_embeddings_line_is_prepared_as_the_endpoint_prepares_it():
    """Each input a prompt-only request asking its embedding, at the batch's priority; a bad
    field refused as `/v1/embeddings` refuses it (`dimensions` past the model's hidden size)."""
    def line(**body) -> BatchLine:
        [parsed] = parse_input(as_jsonl([{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                                          "body": {"model": "demo", **body}}]))
        return parsed

    assert line(input="x").kind == "embedding"
    score, rerank = parse_input(as_jsonl([
        {"custom_id": "s", "method": "POST", "url": "/v1/score",
         "body": {"model": "demo", "text_1": "a", "text_2": "b"}},
        {"custom_id": "r", "method": "POST", "url": "/v1/rerank", "body": {"model": "demo", "query": "a",
                                                                          "documents": ["b", "a"]}}]))
    assert [(x.kind, x.runs_as) for x in (score, rerank)] == [("score", "embedding"), ("rerank", "embedding")]
    assert prepare(rerank, rules()).pairs == [(0, 1), (0, 0)]  # the query is embedded once
    prepared = prepare(line(input=["ab", [5, 6]]), rules(limits=RequestLimits(priorities=True), priority=2))
    assert prepared.prompts == [demo_tokenizer().encode("ab"), [5, 6]]
    assert [(p.embed, p.priority) for p in prepared.params] == [(True, 2), (True, 2)]
    assert prepare(line(input="x", dimensions=HIDDEN_SIZE), rules()).request.dimensions == HIDDEN_SIZE
    for body, param in (({"input": "x", "dimensions": HIDDEN_SIZE + 1}, "dimensions"), ({"input": ""}, "input"),
                        ({"input": "x", "max_tokens": 3}, "max_tokens")):
        with pytest.raises(RequestError) as refused:
            prepare(line(**body), rules())
        assert (refused.value.status, refused.value.param) == (400, param)


def test_a_file_over_the_line_bound_is_refused_whole():
    assert len(parse_input(as_jsonl(batch_lines(5)), max_lines=5)) == 5
    with pytest.raises(InputFileError, match="more than 5 requests") as refused:
        parse_input(as_jsonl(batch_lines(6)), max_lines=5)
    assert refused.value.errors[0]["code"] == "too_many_requests"


def test_each_line_is_held_to_the_request_bounds():
    line = BatchLine(1, "a", "completion", {"model": "demo", "prompt": "hi", "stop": ["a", "b", "c"]})
    assert prepare(line, rules(64)).params[0].stop == ("a", "b", "c")
    with pytest.raises(RequestError, match="3 stop strings, more than this server's limit of 2") as refused:
        prepare(line, rules(64, limits=RequestLimits(max_stop_strings=2)))
    assert refused.value.param == "stop"
