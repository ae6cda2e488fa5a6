"""The device functions that find a row's top-k / top-p / min-p threshold without a sort
(`triton_token_filters`, which `triton_sampling`'s draw runs) against the torch path
(`token_filters`, itself checked against transformers): the same tokens kept per row, under
Triton's interpreter on CPU (compiled on CUDA, the `kernels` mark). A kernel of this test's own
scales a row as the draw does and masks what lies below its threshold, as the draw leaves
it out."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from splitserve.engine.token_filters import apply_min_p, apply_top_k_top_p  # noqa: E402
from splitserve.engine.triton_sampling import BLOCK, WARPS, filter_settings  # noqa: E402
from splitserve.engine.triton_token_filters import DIGIT_BITS, key, scaled, threshold  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (top_k, top_p, min_p) per row: each filter alone, chained, off, at its extremes
SETTINGS = [(-1, 0.9, 0.0), (5, 1.0, 0.0), (50, 0.5, 0.0), (-1, 0.3, 0.01), (999, 0.99, 0.001), (1, 1.0, 0.0),
            (-1, 1e-40, 0.0), (-1, 1.0, 0.2), (3000, 0.95, 0.0), (-1, 1.0, 0.0)]


@triton.jit
def _filter_kernel(x_ptr, out_ptr, row_max_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_logp_ptr, vocab,
                   BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """Row r of x scaled, (x - row_max[r]) / temperature[r], into out with what lies below its
    threshold set to -inf."""
    r = tl.program_id(0)
    row_ptr, row_max, temperature = x_ptr + r * vocab, tl.load(row_max_ptr + r), tl.load(temperature_ptr + r)
    least = threshold(row_ptr, vocab, row_max, temperature, tl.load(top_k_ptr + r), tl.load(top_p_ptr + r),
                      tl.load(min_logp_ptr + r), BLOCK, DIGIT_BITS)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = scaled(row_ptr, offsets, vocab, row_max, temperature)
        tl.store(out_ptr + r * vocab + offsets, tl.where(key(x) < least, float("-inf"), x), mask=offsets < vocab)


def shifted(x: torch.Tensor) -> torch.Tensor:
    return (x - x.amax(dim=-1, keepdim=True)).to(DEVICE)


def both_paths(x: torch.Tensor, settings=SETTINGS, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's, torch's) rows of x scaled at `temperature` and filtered."""
    ks, ps, mps = ([s[i] for s in settings] for i in range(3))
    row_max = x.amax(dim=-1)
    temperatures = torch.full_like(row_max, temperature)
    expected = apply_min_p(apply_top_k_top_p((x - row_max.unsqueeze(1)) / temperatures.unsqueeze(1), ks, ps), mps)
    got = torch.empty_like(x)
    _filter_kernel[(x.shape[0],)](x.contiguous(), got, row_max, temperatures, *filter_settings(ks, ps, mps, x),
                                  x.shape[1], BLOCK=BLOCK, DIGIT_BITS=DIGIT_BITS, num_warps=WARPS)
    return got, expected


@pytest.mark.parametrize("vocab", [1000, 2500])  # one partial block; several with a partial last
def test_kernel_keeps_what_the_torch_filters_keep(vocab):
    x = shifted(torch.randn(len(SETTINGS), vocab, generator=torch.Generator().manual_seed(vocab)) * 3)
    got, expected = both_paths(x)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], x[got.isfinite()])
    assert got.isfinite().sum(dim=-1).min() >= 1


@pytest.mark.parametrize("temperature", [0.3, 3.0])
def test_values_are_scaled_as_torch_scales_them(temperature):
    """Logits as the model gives them: each row's maximum subtracted and the temperature divided in
    the kernel, the values it keeps equal to torch's to the bit."""
    x = torch.randn(len(SETTINGS), 1100, generator=torch.Generator().manual_seed(2)).mul(4).add(7).to(DEVICE)
    got, expected = both_paths(x, temperature=temperature)
    assert torch.equal(got, expected)


def test_ties_masked_tokens_and_signed_zeros():
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


def test_the_least_value_kept_one_float_above_the_greatest_dropped():
    """Their keys share every digit but the last, so the descent must read the bucket to its last
    digit: the top token 0, -1 and the float just below -1 far above the rest (-40 to -60)."""
    settings = [(2, 1.0, 0.0), (3, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.0)]
    x = -40 - 20 * torch.rand(len(settings), 900, generator=torch.Generator().manual_seed(4))
    x[:, 0], x[:, 100] = 0.0, -1.0
    x[:, 200] = torch.nextafter(torch.tensor(-1.0), torch.tensor(-2.0))
    got, expected = both_paths(x.to(DEVICE), settings)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert got[:, 200].isfinite().tolist() == [False, True, False, True]


def test_rows_of_one_value_keep_every_token():
    got, _ = both_paths(torch.zeros(len(SETTINGS), 300, device=DEVICE))
    assert got.isfinite().all()
