"""A batch's usage, read by the official client: its output lines' usage summed, whatever their
endpoint's shape."""
from __future__ import annotations

import openai

from splitserve.api.usage import Usage
from splitserve.batch.usage import BatchUsage


def test_lines_of_either_usage_shape_are_summed():
    usage = BatchUsage()
    for body in (Usage(90, 4, 64, 1, 16).body(), Usage(30, 8, 16, 2, 0).input_output_body()):
        usage.add({"custom_id": "x", "response": {"status_code": 200, "body": {"usage": body}}, "error": None})
    got = openai.types.batch_usage.BatchUsage.model_validate(usage.body())
    assert (got.input_tokens, got.output_tokens, got.total_tokens) == (120, 12, 132)
    assert (got.input_tokens_details.cached_tokens, got.output_tokens_details.reasoning_tokens) == (80, 3)
