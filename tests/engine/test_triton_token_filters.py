"""The Triton top-k / top-p / min-p kernel (`triton_token_filters`) against the torch path
(`token_filters`, itself checked against transformers): the same tokens kept per row, under
Triton's interpreter on CPU (compiled on CUDA, the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine import token_filters  # noqa: E402
from splitserve.engine.sampler import Sampler  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from splitserve.engine.sequence import Sequence  # noqa: E402
from splitserve.engine.token_filters import apply_min_p, apply_top_k_top_p  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (top_k, top_p, min_p) per row: each filter alone, chained, off, at its extremes
SETTINGS = [(-1, 0.9, 0.0), (5, 1.0, 0.0), (50, 0.5, 0.0), (-1, 0.3, 0.01), (999, 0.99, 0.001), (1, 1.0, 0.0),
            (-1, 1e-40, 0.0), (-1, 1.0, 0.2), (3000, 0.95, 0.0), (-1, 1.0, 0.0)]


@pytest.fixture
def kernel_path(monkeypatch):
    """`filter_tokens` through the kernel whatever the device and the batch."""
    monkeypatch.setattr(token_filters, "runs_kernels", lambda x: True)
    monkeypatch.setattr(token_filters, "KERNEL_ROWS", 1)


def shifted(x: torch.Tensor) -> torch.Tensor:
    return (x - x.amax(dim=-1, keepdim=True)).to(DEVICE)


def both_paths(x: torch.Tensor, settings=SETTINGS) -> tuple[torch.Tensor, torch.Tensor]:
    ks, ps, mps = ([s[i] for s in settings] for i in range(3))
    expected = apply_min_p(apply_top_k_top_p(x, ks, ps), mps)
    return token_filters.filter_tokens(x.clone(), ks, ps, mps), expected


@pytest.mark.parametrize("vocab", [1000, 2500])  # one partial block; several with a partial last
def test_kernel_keeps_what_the_torch_filters_keep(kernel_path, vocab):
    x = shifted(torch.randn(len(SETTINGS), vocab, generator=torch.Generator().manual_seed(vocab)) * 3)
    got, expected = both_paths(x)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], x[got.isfinite()])
    assert got.isfinite().sum(dim=-1).min() >= 1


def test_ties_masked_tokens_and_signed_zeros(kernel_path):
    """Values in steps of 0.25 (runs of equal values at every threshold), a third of each row
    already -inf (a grammar's mask), -0.0 beside the maximum +0.0, a row with one finite value."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(len(SETTINGS), 700, generator=gen) * 8).round() / 4
    x[torch.rand(x.shape, generator=gen) < 0.3] = float("-inf")
    x = shifted(x)
    x[:, 0], x[:, 1] = 0.0, -0.0
    x[-1, 2:] = float("-inf")
    got, expected = both_paths(x, SETTINGS[:-1] + [(5, 0.5, 0.1)])
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert got[:, :2].isfinite().all()


def test_rows_of_one_value_keep_every_token(kernel_path):
    got, _ = both_paths(torch.zeros(len(SETTINGS), 300, device=DEVICE))
    assert got.isfinite().all()


def test_sampler_draws_the_same_tokens_through_the_kernel(kernel_path):
    """Seeded requests of every filter: the same draws, so the same tokens, as the torch path."""
    x = torch.randn(len(SETTINGS), 1500, generator=torch.Generator().manual_seed(5)).mul(2).to(DEVICE)
    seqs = [Sequence(f"s{i}", [1], SamplingParams(max_tokens=8, temperature=0.8, top_k=k, top_p=p, min_p=m,
                                                   seed=i)) for i, (k, p, m) in enumerate(SETTINGS)]
    through_kernel = [t.token_id for t in Sampler().sample(x, seqs)]
    token_filters.KERNEL_ROWS = len(SETTINGS) + 1  # restored by monkeypatch
    assert through_kernel == [t.token_id for t in Sampler().sample(x, seqs)]
