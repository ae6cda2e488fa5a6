"""Banned tokens (`token_bans`, `bad_words`) against transformers' logits processors:
`NoBadWordsLogitsProcessor` over the output for vLLM's `bad_words`, `SuppressTokensLogitsProcessor`
of the complement for `allowed_token_ids`."""
import random

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SuppressTokensLogitsProcessor

from splitserve.engine.bad_words import BadWords
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import MAX_BAD_WORDS, SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.engine.token_bans import TokenBans
from splitserve.engine.tokenizer import ByteTokenizer
from tests.engine.hf_checkpoints import train_tokenizer

VOCAB = 300
WORDS = ["ab", "x", "cab a"]
PROMPT = list(b"the ")


def seq(output: list[int], prompt: list[int] = PROMPT, **params) -> Sequence:
    params = SamplingParams(max_tokens=64, **params)
    return Sequence("s", prompt, params, token_ids=prompt + output,
                    bad_words=BadWords.of(params.bad_words, ByteTokenizer()))


def ban_tokens(raw: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return TokenBans().apply(raw, seqs)


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def spellings(words: list[str]) -> list[list[int]]:
    return [list(prefix.encode() + w.encode()) for w in words for prefix in ("", " ")]


def test_bad_words_ban_what_transformers_bans_after_the_output():
    """Random outputs over the words' letters: each step's bans are transformers' for the output
    alone, both spellings of every word (as it starts the text, and after a space)."""
    rng, processor = random.Random(0), NoBadWordsLogitsProcessor(spellings(WORDS), eos_token_id=ByteTokenizer.EOS)
    for case in range(300):
        output = [rng.choice(b"abcx ") for _ in range(rng.randrange(0, 9))]
        raw = logits(seed=case)
        theirs = processor(torch.tensor([output], dtype=torch.long).reshape(1, -1), raw.clone())
        assert torch.equal(ban_tokens(raw, [seq(output, bad_words=WORDS)]), theirs), bytes(output)


def test_a_prompt_ending_with_a_words_first_tokens_does_not_ban_its_last():
    """vLLM's reading: the words are matched against the output, not the prompt."""
    raw = logits()
    got = ban_tokens(raw, [seq([], prompt=list(b"the a"), bad_words=["ab"])])
    assert got[0, ord("b")] == raw[0, ord("b")]
    assert ban_tokens(raw, [seq(list(b"a"), bad_words=["ab"])])[0, ord("b")] == float("-inf")
    across = ban_tokens(raw, [seq(list(b"b "), prompt=list(b"the ca"), bad_words=["cab a"])])
    assert across[0, ord("a")] == raw[0, ord("a")]
    assert ban_tokens(raw, [seq(list(b"cab "), bad_words=["cab a"])])[0, ord("a")] == float("-inf")


def test_a_resumed_requests_earlier_output_counts_as_output():
    """A request resumed elsewhere (its earlier output is the prompt's tail) bans as if it had not moved."""
    got = ban_tokens(logits(), [seq([], prompt=list(b"the a"), bad_words=["ab"], resumed_tokens=1)])
    assert got[0, ord("b")] == float("-inf")


def test_allowed_token_ids_suppress_the_rest_as_transformers_does_and_ignore_ids_past_the_vocabulary():
    allowed = [3, 17, 17, 250, VOCAB + 5]
    raw = logits()
    theirs = SuppressTokensLogitsProcessor([t for t in range(VOCAB) if t not in allowed])(
        torch.tensor([[1]]), raw.clone())
    assert torch.equal(ban_tokens(raw, [seq([], allowed_token_ids=allowed)]), theirs)


def test_rows_are_banned_each_by_their_own_settings():
    raw = logits(4)
    seqs = [seq(list(b"a")), seq(list(b"a"), bad_words=["ab"]), seq([], allowed_token_ids=[5, 6]),
            seq(list(b"a"), bad_words=["ab", "x"], allowed_token_ids=[ord("b"), ord("x"), 7])]
    got = ban_tokens(raw, seqs)
    assert torch.equal(got[0], raw[0])
    assert got[1].isinf().nonzero().flatten().tolist() == [ord("b")]
    assert got[2].isfinite().nonzero().flatten().tolist() == [5, 6]
    assert got[3].isfinite().nonzero().flatten().tolist() == [7]
    assert ban_tokens(raw, [seq([]), seq([])]) is raw


def test_the_sampler_draws_only_what_is_left():
    raw = logits(2)
    for temperature in (0.0, 1.0):
        for seed in range(20):
            tokens = Sampler(seed=seed).sample(raw, [seq([], allowed_token_ids=[4, 9, 200], temperature=temperature),
                                                     seq(list(b"a"), bad_words=["ab"], temperature=temperature,
                                                         logit_bias={ord("b"): 100.0})])
            assert tokens[0].token_id in (4, 9, 200) and tokens[1].token_id != ord("b")


def test_words_are_spelled_both_ways_in_a_byte_level_bpe():
    raw = train_tokenizer()

    class Wrapped(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return raw.encode(text, add_special_tokens=add_special_tokens).ids

    words = BadWords.of(["  fox", "quick brown"], Wrapped())
    expected = {tuple(raw.encode(text, add_special_tokens=False).ids)
                for text in ("fox", " fox", "quick brown", " quick brown")}
    found = {(t,) for t in words.always} | {ids for group in words.after.values() for ids in group}
    assert found == expected and len(expected) == 4
    assert BadWords.of([], Wrapped()) is None


@pytest.mark.parametrize("field,value", [
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.5]),
    ("allowed_token_ids", list(range((1 << 18) + 1))), ("bad_words", ["  "]), ("bad_words", [""]),
    ("bad_words", ["x" * 257]), ("bad_words", ["w"] * (MAX_BAD_WORDS + 1)), ("bad_words", [3])])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_allowed_ids_are_kept_sorted_and_distinct():
    assert SamplingParams(allowed_token_ids=[9, 2, 9]).allowed_token_ids == (2, 9)
    assert SamplingParams(bad_words="one").bad_words == ("one",)
