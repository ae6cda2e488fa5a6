import math

import pytest
import torch

from splitserve.engine.sampler import SampledToken, Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

VOCAB = 64


def make_seq(seq_id="s", num_output_tokens=0, eos=frozenset(), **params) -> Sequence:
    return Sequence(seq_id, [1, 2], SamplingParams(max_tokens=32, **params), eos_token_ids=eos,
                    token_ids=[1, 2] + [3] * num_output_tokens)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_for_any_float_dtype():
    logits = random_logits(5).to(torch.bfloat16)
    seqs = [make_seq(f"s{i}", temperature=0.0) for i in range(4)] + [make_seq("k1", top_k=1)]
    out = Sampler().sample(logits, seqs)
    assert [t.token_id for t in out] == logits.float().argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_over_temperature(temperature):
    draws = 20000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    seqs = [make_seq(f"s{i}", temperature=temperature) for i in range(draws)]
    out = Sampler(seed=1).sample(row.expand(draws, -1), seqs)
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=len(row))
    expected = torch.softmax(row / temperature, dim=-1)
    assert torch.allclose(counts / draws, expected, atol=0.015)


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    logits = random_logits(1, seed=5).expand(2000, -1)
    allowed = set(logits[0].topk(4).indices.tolist())
    out = Sampler().sample(logits, [make_seq(f"s{i}", top_k=4, top_p=0.99) for i in range(2000)])
    assert {t.token_id for t in out} <= allowed
    assert len({t.token_id for t in out}) > 1


def test_sampling_with_min_p_stays_inside_the_kept_set():
    logits = random_logits(1, seed=3).repeat(200, 1)
    kept = logits[0] >= logits[0].max() + math.log(0.3)
    out = Sampler(seed=1).sample(logits, [make_seq(f"s{i}", temperature=1.0, min_p=0.3) for i in range(200)])
    assert all(kept[t.token_id] for t in out) and len({t.token_id for t in out}) > 1


def test_a_filtered_token_is_never_drawn_where_a_sum_steps_at_zeros(monkeypatch):
    """CUDA's scan of a single row adds in another order than a running sum, so a token of
    probability 0 may get a cdf above its predecessor's; a cumsum that steps at every 0 (far more
    than rounding does) must still never give a token top-k dropped."""
    cumsum = torch.Tensor.cumsum
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda self, dim: cumsum(self + (self == 0) * 1e-3, dim))
    logits = random_logits(1, vocab=1000, seed=2)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(seed=1)
    drawn = {sampler.sample(logits, [make_seq("s", top_k=3)])[0].token_id for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_seeded_request_does_not_depend_on_the_batch():
    flat = torch.zeros(1, 1000)  # uniform: every token equally likely, so seeds show clearly
    alone_sampler, batch_sampler = Sampler(seed=0), Sampler(seed=123)
    alone_seq, target = make_seq("target", seed=7, top_p=0.9), make_seq("target", seed=7, top_p=0.9)
    others = [make_seq("a"), make_seq("b", seed=8), make_seq("c", temperature=0.0)]
    alone, in_batch = [], []
    for step in range(6):
        alone.append(alone_sampler.sample(flat, [alone_seq])[0].token_id)
        alone_seq.append_token(alone[-1])
        batch = others[:step % 3] + [target] + others[step % 3:]
        out = batch_sampler.sample(flat.expand(len(batch), -1), batch)
        in_batch.append(out[batch.index(target)].token_id)
        target.append_token(in_batch[-1])
    assert alone == in_batch and len(set(alone)) > 1


def test_a_seeded_draw_depends_on_the_seed_and_the_output_position_alone():
    """So a request sampled in parts (the prompt worker's first token, the token worker's rest; a
    failover's resumed attempt, whose prompt ends with the earlier output) gives one run's tokens."""
    flat = torch.zeros(2, 1000)
    sampler = Sampler()
    x, y = make_seq("x", seed=1), make_seq("y", seed=2)
    for _ in range(5):
        for seq, token in zip((x, y), sampler.sample(flat, [x, y])):
            seq.append_token(token.token_id)
    assert x.output_token_ids != y.output_token_ids and len(set(x.output_token_ids)) > 1
    imported = make_seq("imported", seed=1)  # a token worker's copy: the first token came with the KV
    imported.append_token(x.output_token_ids[0])
    resumed = Sequence("resumed", [1, 2] + x.output_token_ids[:2], SamplingParams(max_tokens=32, seed=1,
                                                                                   resumed_tokens=2))
    elsewhere = Sampler(seed=99)
    for position in range(2, 5):
        assert elsewhere.sample(flat[:1], [resumed])[0].token_id == x.output_token_ids[position]
        resumed.append_token(x.output_token_ids[position])
    assert elsewhere.sample(flat[:1], [imported])[0].token_id == x.output_token_ids[1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_token_ids(temperature):
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 100.0  # eos
    logits[:, 6] = 90.0   # stop token id
    logits[:, 7] = 80.0
    common = dict(eos=frozenset({5}), min_tokens=2, temperature=temperature)
    seqs = [make_seq("early", 1, stop_token_ids=[6], **common),  # below min_tokens: 5 and 6 masked
            make_seq("done", 2, stop_token_ids=[6], **common),   # reached min_tokens: nothing masked
            make_seq("ignore", 0, ignore_eos=True, **common)]    # eos does not stop it: not masked
    out = Sampler().sample(logits, seqs)
    assert [t.token_id for t in out] == [7, 5, 5]


def test_logprobs_come_from_raw_logits():
    logits = random_logits(3, seed=9)
    seqs = [make_seq("a", temperature=0.7, top_k=5, logprobs=3), make_seq("b", temperature=0.0, logprobs=0),
            make_seq("c", temperature=1.3)]
    out = Sampler().sample(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        assert out[row].logprob == pytest.approx(raw[row, out[row].token_id].item(), abs=1e-6)
    values, ids = raw[0].topk(3)
    assert list(out[0].top_logprobs) == ids.tolist()
    assert list(out[0].top_logprobs.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert out[1].top_logprobs == {}
    assert out[2] == SampledToken(out[2].token_id, None, None)


def test_mixed_batch_of_greedy_and_random_rows():
    logits = random_logits(6, seed=11)
    greedy = [0, 2, 5]
    seqs = [make_seq(f"s{i}", temperature=0.0 if i in greedy else 1.0, top_k=2) for i in range(6)]
    out = Sampler().sample(logits, seqs)
    for i, token in enumerate(out):
        if i in greedy:
            assert token.token_id == logits[i].argmax().item()
        else:
            assert token.token_id in logits[i].topk(2).indices.tolist()


def test_logits_shape_must_match_the_batch():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, VOCAB), [make_seq()])


# ---- numerical safety: no temperature / top-k / top-p / logits gives an id outside the vocabulary ----
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HOSTILE_VALUES = [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e30, -1e30, 0.0, 1.0]


@pytest.mark.parametrize("temperature", [1e-300, 1e-10, 9.99e-6])
def test_a_temperature_under_1e_5_is_greedy(temperature):
    logits = random_logits(3)
    seqs = [make_seq(f"s{i}", temperature=temperature) for i in range(3)]
    assert SamplingParams(temperature=temperature).greedy
    assert [t.token_id for t in Sampler().sample(logits, seqs)] == logits.argmax(dim=-1).tolist()


def test_non_finite_temperatures_are_refused():
    for bad in (float("inf"), float("nan"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_the_smallest_random_temperature_on_huge_logits_picks_the_top_token():
    logits = torch.full((1, VOCAB), -3.0e38)
    logits[0, 17] = 3.0e38  # (a - b) / 1e-5 overflows float32 unless the row is shifted first
    assert Sampler().sample(logits, [make_seq(temperature=1e-5)])[0].token_id == 17


def test_nan_logits_are_never_chosen_and_an_all_nan_row_still_gives_an_id():
    logits = torch.full((2, VOCAB), float("nan"))
    logits[0, 5] = 0.0
    out = Sampler().sample(logits, [make_seq("a", temperature=0.7), make_seq("b", temperature=0.7)])
    assert out[0].token_id == 5 and 0 <= out[1].token_id < VOCAB


def test_logprobs_past_a_small_vocabulary_return_every_token():
    logits = random_logits(1, vocab=10)
    out = Sampler().sample(logits, [make_seq(temperature=0.0, logprobs=20)])[0]
    assert sorted(out.top_logprobs) == list(range(10))


def test_a_row_without_a_finite_logit_gives_minus_infinity_logprobs_not_nan():
    out = Sampler().sample(torch.full((1, VOCAB), float("nan")), [make_seq(temperature=0.0, logprobs=2)])[0]
    assert out.logprob == -math.inf and list(out.top_logprobs.values()) == [-math.inf, -math.inf]


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.sampled_from(HOSTILE_VALUES) | st.floats(allow_nan=True, allow_infinity=True,
                                                                    width=32), min_size=VOCAB, max_size=VOCAB),
       temperature=st.sampled_from([0.0, 1e-300, 1e-5, 0.01, 1.0, 2.0, 1e30]) | st.floats(0, 1e6),
       top_k=st.sampled_from([-1, 1, 2, VOCAB, VOCAB * 4]), top_p=st.floats(1e-9, 1.0).filter(lambda p: p > 0),
       seed=st.none() | st.integers(0, 2**63 - 1), logprobs=st.none() | st.integers(0, 20),
       penalties=st.fixed_dictionaries({}, optional={
           "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "min_p": st.floats(0, 1),
           "repetition_penalty": st.sampled_from([1e-30, 0.5, 2.0, 10.0]),
           "logit_bias": st.dictionaries(st.integers(0, VOCAB * 2), st.floats(-100, 100), max_size=4),
           "allowed_token_ids": st.lists(st.integers(0, VOCAB * 2), min_size=1, max_size=6)}))
def test_any_logits_and_settings_give_an_id_in_the_vocabulary(values, temperature, top_k, top_p, seed, logprobs,
                                                                penalties):
    logits = torch.tensor([values], dtype=torch.float32)
    seq = make_seq(num_output_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   logprobs=logprobs, **penalties)
    token = Sampler().sample(logits, [seq])[0]
    assert 0 <= token.token_id < VOCAB
    if logprobs is not None:
        assert not any(math.isnan(v) for v in [token.logprob, *token.top_logprobs.values()])
    candidates = ~(logits.isnan() | logits.isneginf())[0]
    allowed = [t for t in penalties.get("allowed_token_ids", ()) if t < VOCAB]
    if candidates[allowed].any():
        assert token.token_id in allowed  # no bias or penalty takes a banned id back
    if candidates.any() and not penalties:
        assert candidates[token.token_id]  # a NaN or -inf logit is drawn only when every logit is one
