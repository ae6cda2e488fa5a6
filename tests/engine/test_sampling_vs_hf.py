"""Sampling options against Hugging Face transformers on tiny random checkpoints: logprobs and
prompt logprobs against its log-softmax, a repetition penalty, biases and banned tokens against its
`generate`, and structured output over a trained BPE vocabulary (outputs checked with `jsonschema`)."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from splitserve.engine.bad_words import BadWords
from splitserve.engine.llm import LLM
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS, NEW_TOKENS, ckpt, generation_prompts, hf_greedy, hf_logits, tokenizers_by_kind,
)


def test_logprobs_match_hf_log_softmax(ckpt):
    """Each generated token's logprob and its top alternatives: transformers' log-softmax of the
    logits at that position, within 1e-4 (float32), with chunked prefill and batched decodes."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=3))
    for prompt, out in zip(prompts, outputs):
        expected = hf_logits(hf, prompt + out.token_ids).log_softmax(dim=-1)[len(prompt) - 1:-1]
        for step, (token_id, logprobs) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
            top = expected[step].topk(3)
            assert set(logprobs) == set(top.indices.tolist()) | {token_id}
            for t, value in logprobs.items():
                assert abs(value - expected[step, t].item()) < 1e-4, (step, t)


def test_prompt_logprobs_match_hf_log_softmax_even_where_the_prefix_is_cached(ckpt):
    """Every prompt position after the first: its token's logprob and the top alternatives, from
    transformers' log-softmax at the position before, within 1e-4, through chunked prefills. The
    prompts' prefixes are cached by a first run; a run asking for prompt logprobs computes them anyway."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    assert sum(o.num_cached_tokens for o in llm.generate(prompts, SamplingParams(max_tokens=1))) > 0
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.outputs[0].logprobs is None
        expected = hf_logits(hf, prompt).log_softmax(dim=-1)
        for position in range(1, len(prompt)):
            logprobs, row = out.prompt_logprobs[position], expected[position - 1]
            assert set(logprobs) == set(row.topk(2).indices.tolist()) | {prompt[position]}
            for t, value in logprobs.items():
                assert abs(value - row[t].item()) < 1e-4, (position, t)


def test_structured_output_over_a_bpe_vocabulary_parses_and_validates(ckpt):
    """The grammar masks read a trained BPE tokenizer.json (multi-byte tokens, specials); every
    sampled output is JSON that `jsonschema` accepts."""
    path, _ = ckpt
    schema = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
              "properties": {"word": {"enum": ["fox", "dog", "tailor"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}}}
    llm = LLM(path, dtype="float32", **ENGINE_ARGS)
    params = [SamplingParams(max_tokens=40, seed=i, constraint=OutputConstraint.of("json_schema", schema))
              for i in range(6)]
    for out in llm.generate(["the quick brown fox"] * 6, params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_generation_with_a_repetition_penalty_and_biases_matches_hf(ckpt, penalty):
    """transformers' `repetition_penalty` (over prompt and output) and `sequence_bias` for single
    tokens, against ours; a bias large enough changes the text, so the bias is really applied."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    bias = {5: 4.0, 9: -3.0, 11: 2.5}
    expected = [hf_greedy(hf, p, NEW_TOKENS, repetition_penalty=penalty,
                          sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts]
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            repetition_penalty=penalty, logit_bias=bias)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    plain = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert expected != plain


def test_greedy_generation_with_bad_words_and_allowed_ids_matches_hf(ckpt):
    """vLLM's `bad_words` and `allowed_token_ids` against transformers' `bad_words_ids` (the words'
    spellings in ids, both ways) and `suppress_tokens` (every other id). The words are taken from
    the unconstrained output, so the bans change it."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    first = llm.generate(prompts[:1], plain)[0].token_ids
    tokenizer = llm.get_tokenizer()  # the first pair of tokens from the second on, and single token from the
    pairs = (tokenizer.decode(first[i:i + 2]) for i in range(1, 4))  # sixth on, that are not blank
    singles = (tokenizer.decode([t]) for t in first[5:])
    words = [next(w for w in pairs if w.strip()), next(w for w in singles if w.strip())]
    spelled = BadWords.of(words, llm.get_tokenizer())
    bad_ids = [[t] for t in spelled.always] + [list(ids) for group in spelled.after.values() for ids in group]
    allowed = sorted(set(range(3, 60)) | set(first[:4]))
    suppressed = [t for t in range(hf.config.vocab_size) if t not in allowed]
    expected = [hf_greedy(hf, p, NEW_TOKENS, bad_words_ids=bad_ids, suppress_tokens=suppressed) for p in prompts]
    params = dataclasses.replace(plain, bad_words=tuple(words), allowed_token_ids=tuple(allowed))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected and got[0] != first
    assert all(set(ids) <= set(allowed) for ids in got)
