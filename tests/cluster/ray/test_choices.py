"""Several choices (`n`, `best_of`) through a real local cluster: each choice has its own seed
stream (seed + index), so under sampling the choices differ and each equals an independent request
with its seed; the later choices run on the first one's workers once its prefill is cached there.
Several prompts in one completions request: each prompt's choices, numbered by prompt."""
from __future__ import annotations

import httpx
import pytest

from splitserve import SamplingParams

PROMPT = "Several choices, please: "


def test_n_choices_are_distinct_and_equal_to_independent_requests_with_their_seeds(client):
    args = dict(model="demo", prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    got = client.completions.create(n=3, seed=11, **args)
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(got.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3 and got.usage.completion_tokens == 36
    alone = [client.completions.create(seed=11 + i, **args).choices[0].text for i in range(3)]
    assert texts == alone


def test_streamed_chat_choices_interleave_and_each_ends(client):
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], n=2, seed=5,
                                            max_tokens=10, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, finished = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"} and texts[0] != texts[1]
    assert chunk.usage.completion_tokens == 20
    whole = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], n=2, seed=5,
                                           max_tokens=10, extra_body={"ignore_eos": True})
    assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == [texts[0], texts[1]]


def test_best_of_returns_the_likeliest_choices(client):
    args = dict(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=4, **args).choices
    totals = sorted((sum(c.logprobs.token_logprobs), c.text) for c in candidates)
    best = client.completions.create(n=2, best_of=4, **args)
    assert [c.text for c in best.choices] == [text for _, text in reversed(totals[-2:])]
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 32


@pytest.mark.parametrize("body, needle", [({"n": 2, "best_of": 1}, "at least n"),
                                          ({"best_of": 3, "stream": True}, "cannot stream")])
def test_bad_choice_counts_are_400s(server, body, needle):
    response = httpx.post(f"{server}/v1/completions", json={"model": "demo", "prompt": "x", **body})
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_several_prompts_each_get_their_choices_numbered_by_prompt(client, offline):
    prompts = [PROMPT, "Another prompt", [256, 72, 105]]
    args = dict(model="demo", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    got = client.completions.create(prompt=prompts, n=2, seed=7, **args)
    choices = sorted(got.choices, key=lambda c: c.index)
    alone = [client.completions.create(prompt=p, seed=7 + i, **args).choices[0].text for p in prompts for i in range(2)]
    assert [c.index for c in choices] == list(range(6)) and [c.text for c in choices] == alone
    tokenizer = offline.get_tokenizer()
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
    assert got.usage.completion_tokens == 36
    streamed = client.completions.create(prompt=prompts, model="demo", max_tokens=5, temperature=0, stream=True,
                                         echo=True, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    greedy = offline.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
                              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    echoed = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    assert texts == {k: echoed[k] + out.text for k, out in enumerate(greedy)}
