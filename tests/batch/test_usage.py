"""A batch's usage, read by the official client: its output lines' usage summed, whatever their
endpoint's shape (an embeddings line's has no completion tokens)."""
from __future__ import annotations

import json

import openai
import pytest

from splitserve.api.errors import RequestError
from splitserve.api.usage import Usage
from splitserve.batch.lines import error_line, expired_line, result_line
from splitserve.batch.results import ResultLog
from splitserve.batch.usage import BatchUsage


def test_lines_of_either_usage_shape_are_summed():
    usage = BatchUsage()
    for body in (Usage(90, 4, 64, 1, 16).body(), Usage(30, 8, 16, 2, 0).input_output_body(),
                 {"prompt_tokens": 7, "total_tokens": 7}):  # an embeddings line's
        usage.add({"custom_id": "x", "response": {"status_code": 200, "body": {"usage": body}}, "error": None})
    got = openai.types.batch_usage.BatchUsage.model_validate(usage.body())
    assert (got.input_tokens, got.output_tokens, got.total_tokens) == (127, 12, 139)
    assert (got.input_tokens_details.cached_tokens, got.output_tokens_details.reasoning_tokens) == (80, 3)


def test_lines_of_failed_requests_count_nothing_when_a_log_is_read_back(tmp_path):
    """A resumed batch raised KeyError: 'response' or TypeError on the lines the service writes for
    failed requests: `response` null with an `error`, or an error body without usage."""
    path = tmp_path / "log.jsonl"
    lines = [result_line("ok", 200, {"usage": Usage(5, 2).body()}), expired_line("expired"),
             error_line("refused", RequestError("bad request")), error_line("lost", RequestError("busy", 503)),
             {"custom_id": "bare"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    usage = BatchUsage()
    ResultLog(path, usage.add).close()
    assert usage.total == Usage(5, 2)


@pytest.mark.parametrize("response, problem", [
    ("oops", "response is 'oops', not an object with an object body"),
    ({"status_code": 200}, "response is {'status_code': 200}, not an object with an object body"),
    ({"body": [1]}, "response is {'body': [1]}, not an object with an object body"),
    ({"body": {"usage": 7}}, "response.body.usage is 7, not a usage object"),
    ({"body": {"usage": {"prompt_tokens": 1}}}, "response.body.usage is {'prompt_tokens': 1}, not a usage object"),
    ({"body": {"usage": {"input_tokens": "1", "output_tokens": 2}}},
     "response.body.usage is {'input_tokens': '1', 'output_tokens': 2}, not a usage object"),
])
def test_a_line_the_service_cannot_have_written_is_a_value_error_naming_it(response, problem):
    usage = BatchUsage()
    with pytest.raises(ValueError) as error:
        usage.add({"custom_id": "x", "response": response, "error": None})
    assert str(error.value) == f"result line 'x': {problem}; the service writes no such line"
    assert usage.total == Usage()
