"""RunResponse and ChoicesResponse: a run's token deltas as an OpenAI response or SSE stream (no Ray:
a scripted run)."""
from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.api.visible_text import TextStream
from splitserve.api import response_bodies
from splitserve.cluster import large_bodies
from splitserve.cluster.choices_response import ChoicesResponse
from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.run_response import RunResponse
from splitserve.cluster.worker_loop import TokenDelta
from splitserve.engine.output_constraint import HARMONY
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer
from tests.loop_ticks import loop_ticks_during

PROMPT = [256, 72, 105]


class ScriptedRun:
    """Plays the deltas (or raises the error) a dispatch Run would give; records what happened to it."""

    def __init__(self, deltas, error: Exception | None = None, params: SamplingParams = SamplingParams(max_tokens=64)):
        self.request_id, self.prompt, self.tokens, self.params = "cmpl-test", PROMPT, [], params
        self._deltas, self._error, self.aborted = deltas, error, False
        self.finish_reason, self.failures, self.refusals, self.prompt_logprobs = None, 0, 0, None
        self.cached_tokens = self.cache_write_tokens = None
        self.prediction_tokens = (0, 0)

    async def deltas(self):
        for delta in self._deltas:
            if self.aborted:
                return
            self.tokens += delta.token_ids
            if self.cached_tokens is None:
                self.cached_tokens, self.cache_write_tokens = delta.cached_tokens, delta.cache_write_tokens
            if delta.prediction_tokens is not None:
                self.prediction_tokens = delta.prediction_tokens
            yield delta
        if self._error:
            raise self._error

    async def abort(self):
        self.aborted = True


def byte_ids(text: str) -> tuple[int, ...]:
    return tuple(text.encode())


def reply_for(run, stop=(), observed=None, kind="completion"):
    params = SamplingParams(max_tokens=64, stop=stop, logprobs=run.params.logprobs)
    on_done = observed.append if observed is not None else (lambda _: None)
    return ChoicesResponse([[RunResponse(kind, run, "demo", TextStream(ByteTokenizer(), params, PROMPT),
                                         on_done=on_done, num_top=run.params.logprobs)]], 1)


def events(reply, **kwargs) -> list:
    async def collect():
        return [chunk async for chunk in reply.sse(**kwargs)]

    raw = b"".join(asyncio.run(collect())).decode()
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in raw.split("\n\n") if line]


def test_stream_text_usage_and_done():
    run, observed = ScriptedRun([TokenDelta(byte_ids("Hel")), TokenDelta(byte_ids("lo"), "length")]), []
    out = events(reply_for(run, observed=observed), include_usage=True)
    [obs] = observed  # what the metrics get: 5 tokens in two deltas, so 4 gaps (3 within a delta: zero)
    assert (obs.outcome, obs.prompt_tokens, obs.generated_tokens, obs.tbt.count) == ("completed", 3, 5, 4)
    assert obs.ttft <= obs.e2e and obs.tbt.counts[0] >= 3 and 0 < obs.tbt.total < obs.e2e
    assert "".join(e["choices"][0]["text"] for e in out[:-2]) == "Hello"
    assert out[-3]["choices"][0]["finish_reason"] == "length"
    assert out[-2]["choices"] == [] and out[-2]["usage"]["completion_tokens"] == 5 and out[-1] == "[DONE]"


def test_a_partial_stop_string_is_held_back_and_the_stop_ends_the_run():
    run = ScriptedRun([TokenDelta(byte_ids("ab")), TokenDelta(byte_ids("cX")), TokenDelta(byte_ids("YZ"))])
    out = events(reply_for(run, stop=("cXY",)), include_usage=False)
    # "cX" could still become the stop string, so it is never sent; the stop ends the text at "ab"
    assert [e["choices"][0]["text"] for e in out[:-1]] == ["ab", ""]
    assert out[-2]["choices"][0]["finish_reason"] == "stop" and run.aborted


def test_continuous_usage_times_every_delta_even_without_text():
    # 0xC3 alone is an incomplete UTF-8 character: no text yet, but the chunk still counts its token
    run = ScriptedRun([TokenDelta((0xC3,), cached_tokens=2), TokenDelta((0xA9,)), TokenDelta(byte_ids("!"), "length")])
    out = events(reply_for(run), include_usage=False, continuous_usage=True)
    chunks = [e for e in out if e != "[DONE]"]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks] == [2, 2, 2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "é!"


def test_failure_after_tokens_ends_the_stream_with_an_error_event():
    run, observed = ScriptedRun([TokenDelta(byte_ids("Hi"))], RequestFailed("request failed after 3 attempts")), []
    out = events(reply_for(run, observed=observed), include_usage=True)
    assert [o.outcome for o in observed] == ["failed"]
    assert out[0]["choices"][0]["text"] == "Hi"
    assert out[-1]["error"]["message"].startswith("request failed after 3 attempts")
    assert "[DONE]" not in out and not run.aborted


def test_whole_response_and_its_failure():
    done = asyncio.run(reply_for(ScriptedRun([TokenDelta(byte_ids("Hey"), "length")])).whole())
    body = json.loads(done.body)
    assert body["choices"][0]["text"] == "Hey" and body["usage"]["completion_tokens"] == 3
    failed = asyncio.run(reply_for(ScriptedRun([], RequestFailed("no worker could take it"))).whole())
    assert failed.status_code == 503 and "no worker" in json.loads(failed.body)["error"]["message"]


def test_a_client_that_goes_away_aborts_the_run():
    run = ScriptedRun([TokenDelta(byte_ids("a")), TokenDelta(byte_ids("b")), TokenDelta(byte_ids("c"), "length")])

    async def read_one_then_leave():
        stream = reply_for(run).sse(include_usage=False)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(read_one_then_leave())
    assert run.aborted


def test_abort_stops_every_choices_run():
    runs = [ScriptedRun([TokenDelta(byte_ids("Hi"))]) for _ in range(2)]
    params = SamplingParams(max_tokens=64)
    reply = ChoicesResponse([[RunResponse("completion", run, "demo", TextStream(ByteTokenizer(), params, PROMPT))
                              for run in runs]], 2)
    asyncio.run(reply.abort())
    assert [run.aborted for run in runs] == [True, True]


def logprob_deltas(text: str, per_delta: int):
    """Byte-token deltas of `text`, each token with logprob -index/10 and its two runners-up."""
    ids = byte_ids(text)
    entries = [{t: -i / 10, ord("?"): -5.0, ord("!"): -6.0} for i, t in enumerate(ids)]
    return [TokenDelta(ids[i:i + per_delta], "length" if i + per_delta >= len(ids) else None,
                       logprobs=tuple(entries[i:i + per_delta])) for i in range(0, len(ids), per_delta)]


def test_streamed_completion_logprobs_follow_the_text_and_stop_with_it():
    run = ScriptedRun(logprob_deltas("Hello END world", 2), params=SamplingParams(max_tokens=64, logprobs=1))
    chunks = [e for e in events(reply_for(run, stop=["END"]), include_usage=False) if e != "[DONE]"]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    tokens = [t for lp in logprobs for t in lp["tokens"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello "
    assert "".join(tokens) == "Hello END"  # every token the text took, the stop string's included; none after
    offsets = [o for lp in logprobs for o in lp["text_offset"]]
    assert offsets == list(range(len(tokens)))  # one byte per token
    assert [v for lp in logprobs for v in lp["token_logprobs"]] == [-i / 10 for i in range(len(tokens))]
    assert [top for lp in logprobs for top in lp["top_logprobs"]] == [{c: -i / 10} for i, c in enumerate(tokens)]


def test_chat_logprobs_carry_bytes_and_the_top_alternatives_best_first():
    run = ScriptedRun(logprob_deltas("Hi", 5), params=SamplingParams(max_tokens=64, logprobs=2))
    body = json.loads(asyncio.run(reply_for(run, kind="chat").whole()).body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("H", 0.0, [72]), ("i", -0.1, [105])]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["i", "?"]  # the sampled one is likelier here


def many_logprobs_run(tokens: int) -> ScriptedRun:
    """One delta of `tokens` tokens with logprobs and 2 alternatives each."""
    text = "".join(chr(97 + i % 26) for i in range(tokens))
    return ScriptedRun(logprob_deltas(text, tokens), params=SamplingParams(max_tokens=tokens, logprobs=2))


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_many_tokens_logprobs_built_off_the_loop_are_the_same_body(kind, stream, monkeypatch):
    tokens = large_bodies.LOGPROB_TOKENS_ON_LOOP + 1

    def response() -> list[dict]:
        reply = reply_for(many_logprobs_run(tokens), kind=kind)
        out = events(reply, include_usage=True) if stream else [json.loads(asyncio.run(reply.whole()).body)]
        for body in out[:-1] if stream else out:
            del body["created"]
        return out

    threaded = response()
    monkeypatch.setattr(large_bodies, "LOGPROB_TOKENS_ON_LOOP", 10**9)
    assert threaded == response()
    sent = [lp for body in (threaded[:-1] if stream else threaded) for choice in body["choices"]
            if (lp := choice.get("logprobs"))]
    assert sum(len(lp["content" if kind == "chat" else "tokens"]) for lp in sent) == tokens


@pytest.mark.quiet
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_building_many_tokens_logprobs_lets_the_event_loop_run(kind):
    """Building a body of 20k tokens' logprobs is about 0.1 s (completions) to 0.4 s (chat) of
    pure Python on a fast core, more on a busy one: the event loop keeps its turns meanwhile (other
    requests' streams go on: about a turn each 10 ms here). On the loop, it woke once."""
    reply = reply_for(many_logprobs_run(20_000), kind=kind)
    assert asyncio.run(loop_ticks_during(reply.body())) >= 5


def chat_logprobs_body(tokens: int) -> dict:
    """A chat body carrying `tokens` tokens' logprobs at top 5."""
    entry = {"token": "a", "logprob": -0.1, "bytes": [97],
             "top_logprobs": [{"token": chr(48 + j), "logprob": -1.0 - j, "bytes": [48 + j]} for j in range(5)]}
    return {"choices": [{"index": 0, "logprobs": {"content": [dict(entry) for _ in range(tokens)]}}]}


@pytest.mark.quiet
@pytest.mark.parametrize("stream", [False, True])
def test_encoding_a_body_or_chunk_of_many_tokens_logprobs_lets_the_event_loop_run(stream):
    """One call of the C encoder holds the GIL throughout, in a thread or not (0.3 s for a 20k-token
    chat body at top 5 on a busy core, 0.09 s on a fast one): past the threshold, a body or chunk is
    encoded in pieces, in a thread (40k tokens: about 22 turns of the loop on a fast core)."""
    body = chat_logprobs_body(40_000)
    encode = response_bodies.sse_event if stream else large_bodies.json_response
    assert asyncio.run(loop_ticks_during(large_bodies.encoded(body, encode))) >= 10


def test_no_logprobs_unless_asked():
    run = ScriptedRun(logprob_deltas("Hi", 5))
    body = json.loads(asyncio.run(reply_for(run).whole()).body)
    assert body["choices"][0]["logprobs"] is None


def test_several_prompts_number_their_choices_by_prompt_and_best_of_picks_within_each():
    def group(prompt: int, texts: list[str], logprob: list[float], returned: int) -> list[RunResponse]:
        runs = []
        for i, (text, lp) in enumerate(zip(texts, logprob)):
            ids = byte_ids(text)
            cached = 1 + prompt if i == 0 else 3  # a later choice's hit is its first's prefill: not counted
            run = ScriptedRun([TokenDelta(ids, "length", logprobs=tuple({t: lp} for t in ids), cached_tokens=cached,
                                          prediction_tokens=(1, 0) if texts[0] == "aa" else None)])
            runs.append(RunResponse("completion", run, "demo", TextStream(ByteTokenizer(), run.params, PROMPT),
                                    index=prompt * returned + i, num_top=None))
        return runs

    # best_of 2, n 1: each prompt's likelier choice, numbered by prompt
    best = ChoicesResponse([group(0, ["aa", "bb"], [-2.0, -1.0], 1), group(1, ["cc", "dd"], [-1.0, -3.0], 1)], 1)
    body = asyncio.run(best.body())
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "bb"), (1, "cc")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 2,
                                                           "rejected_prediction_tokens": 0}}
    # n 2, streamed: prompt k's choices are 2k and 2k + 1
    streamed = ChoicesResponse([group(0, ["aa", "bb"], [0.0, 0.0], 2), group(1, ["cc", "dd"], [0.0, 0.0], 2)], 2)
    texts = {}
    *chunks, last, done = events(streamed, include_usage=True)
    for event in chunks:
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "aa", 1: "bb", 2: "cc", 3: "dd"}
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 0}
    assert done == "[DONE]"


def reading_reply(output: str, **options) -> ChoicesResponse:
    """A chat choice of `output` (one delta per 3 bytes, then EOS: "stop"), read with `options`."""
    ids = byte_ids(output) + (ByteTokenizer.EOS,)
    deltas = [TokenDelta(ids[i:i + 3], "stop" if i + 3 >= len(ids) else None) for i in range(0, len(ids), 3)]
    text = TextStream(ByteTokenizer(), SamplingParams(max_tokens=64), PROMPT)
    return ChoicesResponse([[RunResponse("chat", ScriptedRun(deltas), "demo", text, **options)]], 1)


@pytest.mark.parametrize("continuous", [False, True])
def test_streamed_reasoning_content_and_hermes_calls_add_up_to_the_whole_choice(continuous):
    output = 'Sum it.</think>\n\nOn it.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    options = dict(thinking=True, tool_names=frozenset({"add"}), tool_parser="hermes")
    whole = json.loads(asyncio.run(reading_reply(output, **options).whole()).body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("Sum it.", "On it.")
    chunks = [e["choices"][0] for e in events(reading_reply(output, **options), include_usage=False,
                                              continuous_usage=continuous) if e != "[DONE]"]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Sum it."
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas).strip() == "On it."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "add" and calls[1]["function"]["arguments"] == '{"a": 2}'
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any("<" in (d.get("content") or "") + d.get("reasoning", "") for d in deltas)  # no tag leaks


@pytest.mark.parametrize("continuous", [False, True])
def test_streamed_harmony_channels_add_up_to_the_whole_choice(continuous):
    output = ("<|channel|>analysis<|message|>Sum it.<|end|><|start|>assistant<|channel|>final<|message|>"
              "It is 5.")
    whole = json.loads(asyncio.run(reading_reply(output, thinking=HARMONY).whole()).body)["choices"][0]
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("Sum it.", "It is 5.")
    deltas = [e["choices"][0]["delta"] for e in events(reading_reply(output, thinking=HARMONY), include_usage=False,
                                                       continuous_usage=continuous) if e != "[DONE]"]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Sum it."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 5."
    assert not any("<|" in (d.get("content") or "") + d.get("reasoning", "") for d in deltas)  # no header leaks
    call = ('<|channel|>analysis<|message|>Use add.<|end|><|start|>assistant<|channel|>commentary to=functions.add'
            ' <|constrain|>json<|message|>{"a": 2}')
    options = dict(thinking=HARMONY, tool_names=frozenset({"add"}), tool_parser="hermes")
    chunks = [e["choices"][0] for e in events(reading_reply(call, **options), include_usage=False) if e != "[DONE]"]
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "add" and calls[1]["function"]["arguments"] == '{"a": 2}'
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("reasoning", "") for c in chunks) == "Use add."


HARMONY_OUTPUT = "<|channel|>analysis<|message|>Sum it.<|end|><|start|>assistant<|channel|>final<|message|>It is 5."


@pytest.mark.parametrize("output, thinking, reasoning", [
    ("Sum it.</think>\n\nIt is 5.", True, "Sum it."),
    ("<think>a<b</think>It is 5.", False, "<think>a<b"),  # a `<` that is no tag is thinking too
    ("It is 5.", False, ""),
    ("Not done thinking", True, "Not done thinking"),  # never closed: all of it
    (HARMONY_OUTPUT, HARMONY, "<|channel|>analysis<|message|>Sum it."),
], ids=["opened-by-prompt", "opened-by-output", "no-thinking", "never-closed", "harmony"])
def test_usage_counts_the_tokens_through_the_last_one_of_the_reasoning(output, thinking, reasoning):
    """completion_tokens_details.reasoning_tokens: one byte token per character here, so the count
    is the length of the output through its reasoning (tags that open it included)."""
    want = {"reasoning_tokens": len(reasoning.encode()), "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0}
    whole = json.loads(asyncio.run(reading_reply(output, thinking=thinking).whole()).body)
    assert whole["usage"]["completion_tokens_details"] == want
    assert whole["usage"]["completion_tokens"] == len(output.encode()) + 1  # and EOS
    *_, last, _ = events(reading_reply(output, thinking=thinking), include_usage=True)
    assert last["usage"]["completion_tokens_details"] == want


def test_a_thinking_the_prompt_did_not_open_is_plain_content_when_the_output_does_not_open_it():
    out = events(reading_reply("It is 5.", thinking=False), include_usage=False)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in out[:-1]) == "It is 5."
    assert not any("reasoning" in e["choices"][0]["delta"] for e in out[:-1])


def test_streamed_mistral_calls_carry_the_ids_mistral_templates_take_back():
    """The mistral format streamed: content until `[TOOL_CALLS]`, then both calls (v11 form), each
    with a 9-character id, the whole choice's reading."""
    output = 'On it.[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]add[ARGS]{"a": 3}'
    options = dict(tool_names=frozenset({"add"}), tool_parser="mistral", call_ids="mistral")
    whole = json.loads(asyncio.run(reading_reply(output, **options).whole()).body)["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in whole["tool_calls"]] == ['{"a": 2}', '{"a": 3}']
    deltas = [e["choices"][0]["delta"] for e in events(reading_reply(output, **options), include_usage=False)
              if e != "[DONE]"]
    assert "".join(d.get("content") or "" for d in deltas) == "On it."
    named = [t for d in deltas for t in d.get("tool_calls", []) if "id" in t]
    assert [t["index"] for t in named] == [0, 1] and all(len(t["id"]) == 9 and t["id"].isalnum() for t in named)
