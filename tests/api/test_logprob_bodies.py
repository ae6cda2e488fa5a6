"""OpenAI's logprobs objects: a logprob JSON cannot carry (-inf, NaN) is reported as vLLM's floor,
so the body stays strict JSON; finite ones pass unchanged and the top list stays ordered."""
import json
import math

from splitserve.api.logprob_bodies import LOGPROB_FLOOR, chat_logprobs, completion_logprobs, token_id_name

ENTRIES = [(1, {1: -math.inf, 2: math.nan, 3: -0.5}), (2, {2: -1.25, 1: -20000.0})]


def text(token_id: int) -> str:
    return f"t{token_id}"


def test_tokens_named_by_their_ids_keep_the_texts_offsets():
    body = completion_logprobs(ENTRIES, 2, lambda t: "x" * (t + 1), offset=4, name=token_id_name)
    assert body["tokens"] == ["token_id:1", "token_id:2"] and body["text_offset"] == [4, 6]
    assert list(body["top_logprobs"][0]) == ["token_id:3", "token_id:1"]


def test_logprobs_json_cannot_carry_are_the_floor():
    body = completion_logprobs(ENTRIES, 2, text)
    assert body["token_logprobs"] == [LOGPROB_FLOOR, -1.25]
    assert [list(top.items()) for top in body["top_logprobs"]] == [[("t3", -0.5), ("t1", LOGPROB_FLOOR)],
                                                                    [("t2", -1.25), ("t1", LOGPROB_FLOOR)]]
    chat = chat_logprobs(ENTRIES, 3, text, lambda t: text(t).encode())
    assert [e["logprob"] for e in chat["content"]] == [LOGPROB_FLOOR, -1.25]
    assert [e["logprob"] for e in chat["content"][0]["top_logprobs"]] == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR]
    for body in (body, chat):
        json.dumps(body, allow_nan=False)  # strict JSON
