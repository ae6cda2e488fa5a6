"""Top-k, top-p and min-p on the torch path (`token_filters`, the Triton kernel's oracle) against
transformers' logits warpers, and what it keeps where values tie at a threshold."""
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from splitserve.engine.token_filters import apply_min_p, apply_top_k_top_p, filter_tokens

VOCAB = 64


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("top_k", [1, 3, 10, VOCAB, VOCAB + 5])
def test_top_k_keeps_the_same_tokens_as_transformers(top_k):
    logits = random_logits(4, seed=top_k)
    ours = apply_top_k_top_p(logits, [top_k] * 4, [1.0] * 4)
    theirs = TopKLogitsWarper(top_k)(None, logits)
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    assert torch.equal(ours[ours.isfinite()], logits[ours.isfinite()])


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.75, 0.95, 0.999])
def test_top_p_keeps_the_same_tokens_as_transformers(top_p):
    logits = random_logits(4, seed=int(top_p * 1000))
    ours = apply_top_k_top_p(logits, [-1] * 4, [top_p] * 4)
    theirs = TopPLogitsWarper(top_p)(None, logits)
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    assert ours.isfinite().sum(dim=-1).min() >= 1


def test_per_row_top_k_then_top_p_matches_transformers_chain():
    settings = [(-1, 1.0), (5, 1.0), (-1, 0.6), (8, 0.9), (2, 0.5), (20, 0.99)]
    logits = random_logits(len(settings), seed=3)
    ours = apply_top_k_top_p(logits, [k for k, _ in settings], [p for _, p in settings])
    for row, (k, p) in enumerate(settings):
        theirs = logits[row:row + 1]
        if k != -1:
            theirs = TopKLogitsWarper(k)(None, theirs)
        theirs = TopPLogitsWarper(p)(None, theirs)
        assert torch.equal(ours[row].isfinite(), theirs[0].isfinite()), (k, p)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9])
def test_min_p_keeps_the_same_tokens_as_transformers(min_p):
    raw = random_logits(4, seed=7)
    theirs = MinPLogitsWarper(min_p)(None, raw.clone())
    assert torch.equal(apply_min_p(raw, [min_p] * 4).isfinite(), theirs.isfinite())


def test_a_top_k_past_the_vocabulary_or_int64_is_off_for_its_row_alone():
    logits = random_logits(3, seed=3)
    ours = apply_top_k_top_p(logits, [VOCAB, 2 ** 63, 3], [1.0] * 3)
    assert torch.equal(ours[:2], logits[:2])
    assert torch.equal(ours[2:], apply_top_k_top_p(logits[2:], [3], [1.0]))
    assert torch.equal(apply_top_k_top_p(logits, [2 ** 70] * 3, [1.0] * 3), logits)


def test_values_tied_with_the_least_kept_are_all_kept():
    """Top-p's boundary inside a run of equal values keeps the whole run (transformers keeps the
    part its sort order puts last), and so does top-k's."""
    row = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0, -5.0]])
    # the top token holds about 0.4 of the mass: top_p 0.5 reaches into the tied run
    assert apply_top_k_top_p(row, [-1], [0.5]).isfinite().tolist() == [[True] * 5 + [False]]
    assert apply_top_k_top_p(row, [2], [1.0]).isfinite().tolist() == [[True] * 5 + [False]]


def test_filter_tokens_chains_the_three_and_leaves_rows_without_filters_alone():
    logits = random_logits(3, seed=11)
    scaled = logits - logits.amax(dim=-1, keepdim=True)
    got = filter_tokens(scaled, [5, -1, -1], [0.9, 1.0, 1.0], [0.0, 0.0, 0.3])
    assert torch.equal(got[0].isfinite(), apply_top_k_top_p(scaled[:1], [5], [0.9])[0].isfinite())
    assert torch.equal(got[1], scaled[1])
    assert torch.equal(got[2].isfinite(), apply_min_p(scaled[2:], [0.3])[0].isfinite())
    assert filter_tokens(scaled, [-1] * 3, [1.0] * 3, [0.0] * 3) is scaled
