"""The sampler's draw in one Triton kernel (`triton_sampling`) against the sampler's torch path
(the oracle): the same tokens from the same uniforms under every filter setting and several
temperatures, rows with no finite logit, ties and masked runs, and never a token the filters drop,
whatever the uniform; under Triton's interpreter on CPU (compiled on CUDA, the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine import sampler  # noqa: E402
from splitserve.engine.sampler import Sampler  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from splitserve.engine.sequence import Sequence  # noqa: E402
from splitserve.engine.token_filters import filter_tokens  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (top_k, top_p, min_p) per row: each filter alone, chained, off, at its extremes
SETTINGS = [(-1, 0.9, 0.0), (5, 1.0, 0.0), (50, 0.5, 0.0), (-1, 0.3, 0.01), (999, 0.99, 0.001), (1, 1.0, 0.0),
            (-1, 1e-40, 0.0), (-1, 1.0, 0.2), (3000, 0.95, 0.0), (-1, 1.0, 0.0)]
TEMPERATURES = [0.8, 0.05, 1.7]


def requests(settings=SETTINGS, temperatures=TEMPERATURES, seeded=True) -> list[Sequence]:
    """Each setting at each temperature, a seed a row."""
    rows = [(s, t) for s in settings for t in temperatures]
    return [Sequence(f"s{i}", [1], SamplingParams(max_tokens=8, temperature=t, top_k=k, top_p=p, min_p=m,
                                                   seed=i if seeded else None))
            for i, ((k, p, m), t) in enumerate(rows)]


def draws(logits: torch.Tensor, seqs: list[Sequence], kernel: bool, monkeypatch) -> list[int]:
    """The sampler's tokens, through the kernel or the torch path."""
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "runs_kernels", lambda x: kernel)
        patch.setattr(sampler, "KERNEL_ROWS", 1)
        return [t.token_id for t in Sampler().sample(logits.to(DEVICE), seqs)]


@pytest.mark.parametrize("vocab", [700, 5000])  # one streaming block, partly; two, the second partly
def test_kernel_draws_the_torch_paths_tokens(monkeypatch, vocab):
    seqs = requests()
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    got = draws(logits, seqs, True, monkeypatch)
    assert got == draws(logits, seqs, False, monkeypatch)
    assert len(set(got)) > len(seqs) // 2  # draws, not one token a row


def test_unseeded_rows_follow_the_shared_generator(monkeypatch):
    """Both paths take the batch's uniforms from the sampler's generator alike."""
    seqs = requests(SETTINGS[:3], [1.0], seeded=False)
    logits = torch.randn(len(seqs), 900, generator=torch.Generator().manual_seed(3))
    assert draws(logits, seqs, True, monkeypatch) == draws(logits, seqs, False, monkeypatch)


def test_masked_runs_ties_and_rows_with_no_finite_logit(monkeypatch):
    """A third of each row -inf (a grammar's mask), values in steps of 0.25 (ties at every
    threshold), -0.0 beside +0.0 at the top, a row with one finite value (always its token) and
    one with none (its greedy id, 0, on both paths)."""
    seqs = requests(temperatures=[1.0])
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(seqs), 800, generator=gen) * 8).round() / 4
    logits[torch.rand(logits.shape, generator=gen) < 0.3] = float("-inf")
    logits[:, 0], logits[:, 1] = 10.0, 10.0
    logits[-2, :] = float("-inf")
    logits[-2, 77] = -3.0
    logits[-1, :] = float("-inf")
    got = draws(logits, seqs, True, monkeypatch)
    assert got == draws(logits, seqs, False, monkeypatch)
    assert got[-2:] == [77, 0]


@pytest.mark.parametrize("u", [1.0, 1e-7, 0.5])
def test_a_dropped_token_is_never_drawn(monkeypatch, u):
    """Whatever the uniform, from just above 0 to 1 (the ends of the cumulative mass), the token
    drawn is one the torch filters keep."""
    seqs = requests(temperatures=[0.7])
    logits = torch.randn(len(seqs), 1200, generator=torch.Generator().manual_seed(7)) * 2
    monkeypatch.setattr(Sampler, "_uniforms",
                        lambda self, rows, offsets, device: torch.full((len(rows),), u, device=device))
    got = draws(logits, seqs, True, monkeypatch)
    shifted = (logits - logits.amax(dim=-1, keepdim=True)) / 0.7
    kept = filter_tokens(shifted, *([s.params.top_k for s in seqs], [s.params.top_p for s in seqs],
                                    [s.params.min_p for s in seqs])).isfinite()
    assert all(kept[row, token] for row, token in enumerate(got))
