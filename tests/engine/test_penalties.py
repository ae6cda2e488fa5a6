"""Biases and penalties on a batch's logits (the sampler's `Penalties`)
against transformers' logits processors and OpenAI's documented frequency / presence formula."""
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from splitserve.engine.penalties import Penalties
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

VOCAB = 32
PROMPT, OUTPUT = [3, 4, 4, 9], [9, 9, 12, 4, 20]


def seq(seq_id: str = "s", **params) -> Sequence:
    return Sequence(seq_id, PROMPT, SamplingParams(max_tokens=32, **params), token_ids=PROMPT + OUTPUT)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return Penalties().apply(logits, seqs)


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.7])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty):
    raw = logits()
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), raw.clone())
    assert torch.allclose(apply_penalties(raw, [seq(repetition_penalty=penalty)]), theirs)


def test_logit_bias_is_transformers_sequence_bias_and_ignores_ids_past_the_vocabulary():
    raw, bias = logits(), {2: 5.0, 9: -7.5, 31: 100.0, VOCAB + 3: 50.0}
    in_vocab = {(t,): b for t, b in bias.items() if t < VOCAB}
    theirs = SequenceBiasLogitsProcessor(in_vocab)(torch.tensor([PROMPT + OUTPUT]), raw.clone())
    assert torch.allclose(apply_penalties(raw, [seq(logit_bias=bias)]), theirs)


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.5), (-1.0, 2.0)])
def test_frequency_and_presence_follow_openais_formula_over_the_output_only(frequency, presence):
    raw = logits()
    expected = raw.clone()
    for token, count in Counter(OUTPUT).items():  # logit -= count * frequency + (count > 0) * presence
        expected[0, token] -= count * frequency + presence
    got = apply_penalties(raw, [seq(frequency_penalty=frequency, presence_penalty=presence)])
    assert torch.allclose(got, expected)
    assert got[0, 3] == raw[0, 3]  # in the prompt only: untouched


def test_ragged_rows_are_each_counted_over_their_own_tokens():
    """Rows of different lengths, one with no output yet: each as transformers' repetition and
    OpenAI's formula give it alone (the counts lay the rows end to end)."""
    lists = [([5], []), ([1] * 40 + [7], [7, 2]), (PROMPT, OUTPUT)]
    seqs = [Sequence(f"s{i}", prompt, SamplingParams(max_tokens=64, repetition_penalty=1.3, frequency_penalty=0.25,
                                                      presence_penalty=0.5), token_ids=prompt + output)
            for i, (prompt, output) in enumerate(lists)]
    raw = logits(3)
    repetition = RepetitionPenaltyLogitsProcessor(1.3)
    expected = torch.cat([repetition(torch.tensor([prompt + output]), raw[row:row + 1].clone())
                          for row, (prompt, output) in enumerate(lists)])
    for row, (_, output) in enumerate(lists):
        for token, count in Counter(output).items():
            expected[row, token] -= count * 0.25 + 0.5
    assert torch.allclose(apply_penalties(raw, seqs), expected)


def test_rows_without_penalties_are_untouched_in_a_mixed_batch():
    raw = logits(3)
    got = apply_penalties(raw, [seq("a"), seq("b", presence_penalty=1.0), seq("c")])
    assert torch.equal(got[0], raw[0]) and torch.equal(got[2], raw[2]) and not torch.equal(got[1], raw[1])
    assert apply_penalties(raw, [seq("a"), seq("b"), seq("c")]) is raw


def test_a_strong_bias_decides_a_greedy_token():
    assert Sampler().sample(logits(), [seq(temperature=0.0, logit_bias={17: 100.0})])[0].token_id == 17


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.5),
                                         ("repetition_penalty", 0), ("repetition_penalty", float("nan")),
                                         ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}),
                                         ("logit_bias", {i: 1.0 for i in range(301)})])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_one_penalties_over_many_steps_counts_what_each_step_appended():
    """The kept token tensors grow with the sequences (past their buffers), let go of a sequence
    that sits a step out and rebuild it when it returns: every step equals a fresh count."""
    kept = Penalties()
    params = SamplingParams(max_tokens=200, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    a, b = (Sequence(name, list(PROMPT), params) for name in "ab")
    for step in range(150):
        batch = [a] if step % 7 == 3 else [a, b]
        raw = logits(len(batch), seed=step)
        assert torch.equal(kept.apply(raw, batch), Penalties().apply(raw, batch))
        assert set(kept._tokens) == set(batch)
        for running in batch:
            running.append_token((step * 7 + len(running.seq_id)) % VOCAB)
    raw = logits()
    assert kept.apply(raw, [seq("plain")]) is raw and not kept._tokens  # a batch without penalties holds nothing
