"""JSON made piece by piece is byte for byte what one call of the stdlib's encoder makes, and what
JSONResponse and the SSE framing send."""
from __future__ import annotations

import json
import math

import pytest

from splitserve.api import response_bodies as R
from splitserve.api.json_pieces import LONG_LIST, dumps_in_pieces
from splitserve.cluster.large_bodies import json_response


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def entry(i: int) -> dict:
    return {"token": f"t\u2028{i}é\"", "logprob": -i / 7, "bytes": [116, i % 256],
            "top_logprobs": [{"token": "\x85", "logprob": -1.5, "bytes": []}]}


VALUES = {
    "long lists, nested": {"choices": [{"index": 0, "logprobs": {"content": [entry(i) for i in range(LONG_LIST + 5)],
                                                                  "refusal": None}}]},
    "completions' shape": {"logprobs": {"tokens": ["a"] * 300, "token_logprobs": [-0.5] * 300,
                                        "top_logprobs": [{"a": -0.5, "b": -1.0}] * 300, "text_offset": list(range(300))}},
    "empties and scalars": {"a": [], "b": {}, "c": None, "d": True, "e": 1.0e-300, "f": "", "g": (1, (2,), [])},
    "keys not all strings": {"x": {1: "one", "2": "two"}, "y": [{None: 0}] * 70},
    "a bare long list": list(range(200)),
    "an infinite logprob": [{"logprob": -math.inf}] * 100,  # the SSE framing allows what JSONResponse refuses
    "a scalar": "plain",
}


@pytest.mark.parametrize("name", VALUES)
def test_pieces_make_the_encoders_text(name):
    value = VALUES[name]
    assert dumps_in_pieces(value, compact) == compact(value)


@pytest.mark.parametrize("name", VALUES)
def test_pieces_keep_the_encoders_default_separators(name):
    value = VALUES[name]
    assert dumps_in_pieces(value, json.dumps, (", ", ": ")) == json.dumps(value)


@pytest.mark.parametrize("name", ["long lists, nested", "completions' shape", "empties and scalars"])
def test_a_response_and_an_event_in_pieces_are_the_same_bytes(name):
    value = VALUES[name]
    assert json_response(value, in_pieces=True).body == json_response(value).body
    assert json_response(value, in_pieces=True).headers["content-type"] == "application/json"
    assert R.sse_event(value, in_pieces=True) == R.sse_event(value)


def test_a_value_json_refuses_is_refused_in_pieces_too():
    body = {"content": [{"logprob": math.nan}] * 100}
    with pytest.raises(ValueError):
        json_response(body, in_pieces=True)
