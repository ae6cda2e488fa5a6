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


def test_a_penalty_overflowing_a_huge_logit_keeps_it_finite_and_a_banned_one_stays_banned():
    """-3.4e38 (seen: 4 is in the prompt) times a repetition penalty of 2 is -inf in float32: kept
    the most negative finite value, so the one id allowed (every other at -inf) is still drawn."""
    raw = torch.full((1, VOCAB), float("-inf"))
    raw[0, 4] = -3.4e38
    out = apply_penalties(raw, [seq(repetition_penalty=2.0, frequency_penalty=1.0)])
    assert out[0, 4] == -torch.finfo(torch.float32).max and out[0, 4:5].isfinite().all()
    assert out[0, [i for i in range(VOCAB) if i != 4]].isneginf().all()
    params = dict(repetition_penalty=2.0, temperature=0.0, allowed_token_ids=[4])
    assert Sampler().sample(torch.full((1, VOCAB), float("nan")).index_fill_(1, torch.tensor([4]), -3.4e38),
                            [seq(**params)])[0].token_id == 4


def test_a_strong_bias_decides_a_greedy_token():
    assert Sampler().sample(logits(), [seq(temperature=0.0, logit_bias={17: 100.0})])[0].token_id == 17


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.5),
                                         ("repetition_penalty", 0), ("repetition_penalty", float("nan")),
                                         ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}),
                                         ("logit_bias", {i: 1.0 for i in range(301)})])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def penalized_alone(raw: torch.Tensor, batch: list[Sequence]) -> torch.Tensor:
    """Each row as transformers' repetition penalty (1.3) and OpenAI's formula (0.5, 0.25) give it
    from the whole context, ids past the vocabulary left out."""
    rows = []
    for row, s in enumerate(batch):
        context = [t for t in s.token_ids if t < VOCAB]
        expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([context]), raw[row:row + 1].clone())
        for token, count in Counter(t for t in s.token_ids[s.num_prompt_tokens:] if t < VOCAB).items():
            expected[0, token] -= count * 0.5 + 0.25
        rows.append(expected)
    return torch.cat(rows)


def test_one_penalties_over_many_steps_counts_what_each_step_appended():
    """The kept counts follow each step's new tokens (now and then two at once, once an id past the
    vocabulary), give the row of a sequence that sits a step out to another and count it whole when
    it returns: every step is what the whole contexts give. The pools hold the most rows one step
    needed."""
    kept = Penalties()
    params = SamplingParams(max_tokens=300, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    a, b, c = (Sequence(name, PROMPT + [VOCAB + 5], params) for name in "abc")  # an id past the vocabulary
    for step in range(150):
        batch = [a, c] if step % 7 == 3 else [b, c, a] if step % 5 == 0 else [a, b, c]
        raw = logits(len(batch), seed=step)
        assert torch.allclose(kept.apply(raw, batch), penalized_alone(raw, batch))
        assert set(kept._rows) == set(batch) and len(kept._output) == 3
        for running in batch:
            for _ in range(1 + (step % 11 == 0)):
                past = step == 20 and running is a  # as a checkpoint whose tokenizer outgrew its logits might
                running.append_token(VOCAB + 2 if past else (step * 7 + ord(running.seq_id)) % VOCAB)
    raw = logits()
    assert kept.apply(raw, [seq("plain")]) is raw and not kept._rows  # a batch without penalties holds nothing


def test_a_resumed_requests_earlier_output_counts_as_output():
    """A request failover resumed: its earlier output arrives in its prompt (`resumed_tokens`)."""
    params = SamplingParams(max_tokens=32, frequency_penalty=0.5, resumed_tokens=len(OUTPUT))
    resumed = Sequence("r", PROMPT + OUTPUT, params)
    kept, raw = Penalties(), logits()
    for step in range(3):
        expected = raw.clone()
        for token, count in Counter(resumed.token_ids[len(PROMPT):]).items():
            expected[0, token] -= count * 0.5
        assert torch.allclose(kept.apply(raw, [resumed]), expected)
        resumed.append_token(step + 1)
