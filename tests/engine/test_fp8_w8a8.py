"""The W8A8 GEMM (`model/fp8_w8a8.py`): its activation codes and scales against torch's float8
conversion (the same bits), its products against the float64 oracle of those codes, and how far
W8A8 lands from the W8A16 product (the dequantized weight times the activations as they are);
under Triton's interpreter on CPU, compiled on CUDA where it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine import fp8  # noqa: E402
from splitserve.engine.model import fp8_w8a8  # noqa: E402
from tests.engine.test_fp8_linear import HALF, weight  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def activations(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose groups differ in magnitude by up to 2**12, with exact zeros and e4m3's subnormal
    range inside (codes below 2**-6 of a group's largest)."""
    g = torch.Generator().manual_seed(seed)
    spread = 2.0 ** torch.randint(-6, 7, (tokens, -(-k // fp8_w8a8.GROUP)), generator=g).float()
    x = torch.randn(tokens, k, generator=g) * spread.repeat_interleave(fp8_w8a8.GROUP, 1)[:, :k]
    x[:, ::7] *= 1e-4
    x[:, ::11] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("tokens, k", [(1, 128), (37, 300), (64, 1000)])
def test_the_activation_codes_and_scales_equal_torchs(dtype, tokens, k):
    x = activations(tokens, k, seed=tokens + k).to(dtype)
    codes, scales = fp8_w8a8.quantize(x.to(DEVICE))
    want_codes, want_scales = fp8_w8a8.quantize_reference(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (tokens, k)
    assert scales.shape == (-(-k // fp8_w8a8.GROUP), tokens)
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))


def test_a_group_of_zeros_quantizes_to_zero_codes():
    codes, scales = fp8_w8a8.quantize(torch.zeros(3, 256, device=DEVICE))
    assert not codes.cpu().float().any() and torch.isfinite(scales).all() and (scales > 0).all()


def test_the_largest_magnitude_of_a_group_is_a_code_of_448():
    x = activations(5, 384, seed=1)
    codes, _ = fp8_w8a8.quantize(x.to(DEVICE))
    top = codes.cpu().float().abs().view(5, 3, fp8_w8a8.GROUP).amax(-1)
    assert torch.equal(top, torch.full((5, 3), 448.0))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("n, k, block", [
    (200, 320, (128, 128)),       # Qwen's and DeepSeek's blocks, partial both ways
    (96, 256, (32, 128)),         # blocks of fewer rows than a tile's columns
    (130, 384, (128, 256)),       # a block of columns spans two k steps
    (70, 200, fp8.ROWS)])         # one scale a row (compressed-tensors' channel scheme)
@pytest.mark.parametrize("tokens", [1, 130])  # one tile of rows, and two with the second partial
def test_the_w8a8_gemm_equals_the_float64_oracle_of_its_codes(dtype, n, k, block, tokens):
    codes, scales = weight(n, k, (1, k) if block == fp8.ROWS else block, seed=n + tokens)
    x = activations(tokens, k, seed=tokens).to(dtype)
    out = torch.empty((tokens, n), dtype=dtype, device=DEVICE)
    fp8_w8a8.matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), block, out)
    expected = fp8_w8a8.reference(x, codes, scales, block)
    # FP8 tensor cores sum a 128-deep dot at about 14 bits of mantissa (DeepSeek-V3's report of
    # Hopper; Triton leaves sm_90's fp8 dots so): float32's bound is float error only on the CPU
    exact = 1e-5 if DEVICE.type == "cpu" else 2e-3
    tolerance = {torch.float32: exact, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert (out.cpu().double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_w8a8_is_within_e4m3s_rounding_of_the_w8a16_product():
    """The activations' codes carry 3 bits of mantissa: a product of 1024 terms lands within a
    few percent of the unquantized activations' (the W8A16 oracle), far closer than a wrong scale."""
    codes, scales = weight(256, 1024, (128, 128), seed=3)
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(4))
    out = torch.empty((16, 256), device=DEVICE)
    fp8_w8a8.matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), (128, 128), out)
    exact = F.linear(x, fp8.dequantize(codes, scales, (128, 128), torch.float32))
    relative = (out.cpu() - exact).norm() / exact.norm()
    assert 1e-3 < relative.item() < 0.04


def test_blocks_narrower_than_a_group_are_refused():
    codes, scales = weight(64, 128, (64, 64), seed=5)
    with pytest.raises(ValueError, match="whole 128-column groups"):
        fp8_w8a8.matmul(torch.zeros(2, 128), codes, scales, (64, 64), torch.empty(2, 64))


def test_only_cuda_gpus_with_fp8_tensor_cores_run_it():
    assert not fp8_w8a8.supported(torch.device("cpu"), (128, 128))
    # forced, the interpreter runs it on the CPU too, in whole groups of columns
    assert fp8_w8a8.runs_on(torch.device("cpu"), (128, 128)) and not fp8_w8a8.runs_on(torch.device("cpu"), (64, 64))
    if torch.cuda.is_available():
        fp8_cores = torch.cuda.get_device_capability() >= fp8_w8a8.CAPABILITY
        assert fp8_w8a8.supported(torch.device("cuda", 0), fp8.ROWS) == fp8_cores
        assert not fp8_w8a8.supported(torch.device("cuda", 0), (64, 64))
