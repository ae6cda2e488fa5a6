"""Which bodies the ingress builds or encodes in a thread: counted by the tokens whose logprobs they
carry, in either API's shapes. A long text is decoded with no collection started inside, the
collector on again after."""
from __future__ import annotations

import asyncio
import gc
import json
import threading

from splitserve.cluster.large_bodies import LOGPROB_TOKENS_ON_LOOP, TEXT_CHARS_PAUSED, built, decoded, logprob_tokens


def test_logprob_tokens_counts_every_choices_tokens_in_either_shape():
    completion = {"logprobs": {"tokens": ["a", "b"], "token_logprobs": [0.0, -1.0], "top_logprobs": [{}, {}]}}
    chat = {"logprobs": {"content": [{"token": "c"}] * 3, "refusal": None}}
    refusal = {"logprobs": {"content": None, "refusal": [{"token": "no"}]}}
    assert logprob_tokens({"choices": [completion, chat, refusal, {"logprobs": None}]}) == 6
    assert logprob_tokens({"choices": [], "usage": {"prompt_tokens": 3}}) == 0  # the usage chunk
    assert logprob_tokens({"choices": [{"delta": {"content": "x"}}]}) == 0


def test_logprob_tokens_finds_the_responses_apis_wherever_they_sit():
    text = {"type": "output_text", "text": "ab", "annotations": [], "logprobs": [{"token": "a"}, {"token": "b"}]}
    message = {"type": "message", "content": [text, {**text, "logprobs": []}]}
    response = {"object": "response", "output": [{"type": "reasoning", "content": []}, message, message]}
    assert logprob_tokens(response) == 4
    assert logprob_tokens({"type": "response.completed", "response": response}) == 4
    assert logprob_tokens({"type": "response.output_text.done", "text": "ab", "logprobs": text["logprobs"]}) == 2
    assert logprob_tokens({"type": "response.content_part.done", "part": text}) == 2
    assert logprob_tokens({"object": "list", "data": [message]}) == 2


def test_built_runs_past_the_threshold_in_a_thread():
    def where(*args):
        return threading.current_thread() is threading.main_thread(), args

    async def both():
        return await built(LOGPROB_TOKENS_ON_LOOP, where, 1), await built(LOGPROB_TOKENS_ON_LOOP + 1, where, 2)

    assert asyncio.run(both()) == ((True, (1,)), (False, (2,)))


def test_a_long_text_is_decoded_with_the_collector_paused_and_a_short_one_as_ever():
    long_text = json.dumps([{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "b"}]}] * 20_000)
    assert len(long_text) > TEXT_CHARS_PAUSED
    started = []

    def count(phase, info):
        started.extend([info["generation"]] if phase == "start" else [])

    gc.callbacks.append(count)
    try:
        value = decoded(long_text)
        during = len(started)
        started.clear()
        assert value == json.loads(long_text) and gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    assert during <= 2 < len(started)  # one as the collector is on again, at most; json.loads alone starts many
    assert decoded('{"a": [1, 2]}') == {"a": [1, 2]}
