"""The W4A16 / W8A16 GEMM (`model/int_linear.py`) and its dequantizing kernel against the torch oracle
(`int_weights.dequantize`, checked against compressed-tensors in test_int_weights, then `F.linear`):
4 and 8 bits, groups within a k tile, across it and a row's, with zero points and without, partial
words, tiles and groups; and a packed checkpoint's logits with its projections kept packed through
it. The kernels run under Triton's interpreter on CPU, compiled on CUDA where it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine import fp8  # noqa: E402
from splitserve.engine.int_weights import IntWeights, dequantize  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine.model import int_linear, split_k  # noqa: E402
from splitserve.engine.model.linear import Linear  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.hf_checkpoints import (  # noqa: E402,F401 (fixture)
    ENGINE_ARGS, generation_prompts, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.test_fp8_linear import DEVICE, HALF, TOLERANCE  # noqa: E402
from tests.engine.test_int_weights import pack_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernels


def packed_weight(n: int, k: int, scheme: IntWeights, seed: int):
    """Random words (every bit pattern is a valid pack), scales spread 16x between groups, and
    random zero points where the scheme has them."""
    g = torch.Generator().manual_seed(seed)
    words = lambda rows, cols: torch.randint(-2**31, 2**31 - 1, (rows, cols), generator=g, dtype=torch.int64).to(
        torch.int32)
    groups = -(-k // (scheme.group_size or k))
    packed = words(n, -(-k * scheme.bits // 32))
    scale = 0.01 * 2.0 ** torch.randint(-2, 3, (n, groups), generator=g).float()
    zero = None if scheme.symmetric else words(-(-n * scheme.bits // 32), groups)
    return packed, scale, zero


def oracle(x, packed, scale, zero, scheme, k):
    parts = {"packed": packed, "scale": scale, "shape": torch.tensor([packed.shape[0], k])}
    if zero is not None:
        parts["zero_point"] = zero
    return F.linear(x.float(), dequantize(parts, scheme, x.dtype).float())


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


SCHEMES = [IntWeights(4, 16, True), IntWeights(4, 128, False), IntWeights(4, None, False), IntWeights(8, 32, False),
           IntWeights(8, None, True)]


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("n, k", [(96, 256), (70, 100)])  # whole tiles; a partial word, k tile and group
@pytest.mark.parametrize("tokens", [1, 17, 70])  # each tile shape: 16, 64 and 128 rows
def test_the_integer_gemm_equals_the_dequantized_oracle(dtype, scheme, n, k, tokens):
    packed, scale, zero = packed_weight(n, k, scheme, seed=n + tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    expected = oracle(x, packed, scale, zero, scheme, k)
    for path in int_linear.PATHS:
        out = int_linear.matmul(x.to(DEVICE), *on_device(packed, scale, zero), scheme, path=path).cpu()
        assert out.dtype == dtype and out.shape == expected.shape
        bound = TOLERANCE[dtype] * expected.abs().max().item()
        assert (out.float() - expected).abs().max().item() <= bound, path


@pytest.mark.parametrize("scheme", [IntWeights(4, 32, False), IntWeights(8, None, True)], ids=str)
@pytest.mark.parametrize("tokens", [1, 40])  # the 16- and 64-row tiles
@pytest.mark.parametrize("splits", [2, 3, 16])  # even, uneven (the last split shorter), more than k tiles
def test_a_decode_tile_split_over_k_equals_the_oracle(scheme, tokens, splits):
    """Each split's float32 sums added by the tile's last split (k 320: five 64-wide k tiles, a
    group across splits where a row has one), its counters put back to 0."""
    n, k = 96, 320
    packed, scale, zero = packed_weight(n, k, scheme, seed=splits)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
    out = int_linear.matmul(x.to(DEVICE), *on_device(packed, scale, zero), scheme, splits=splits).cpu()
    expected = oracle(x, packed, scale, zero, scheme, k)
    assert (out - expected).abs().max().item() <= TOLERANCE[torch.float32] * expected.abs().max().item()
    assert not split_k.counters(DEVICE).any()


def test_decode_tiles_split_to_fill_the_multiprocessors():
    """Llama-3-8B's o_proj at 4 bits on an H100 (32 tiles of 128 outputs; 64 k tiles of 64): 8 splits
    for up to 16 tokens, 2 for up to 64 (a split reads at least four times its sums' bytes in
    words: 32 k tiles for the 64-row tile), none beyond; 8 bits' words reach it sooner."""
    plans = {tokens: int_linear.split_plan(tokens, 4096, 4096, 4, 132) for tokens in (1, 16, 17, 64, 65)}
    assert plans == {1: (8, 512), 16: (8, 512), 17: (2, 2048), 64: (2, 2048), 65: (1, 4096)}
    assert int_linear.split_plan(64, 4096, 4096, 8, 132) == (4, 1024)
    assert int_linear.split_plan(1, 4096, 4096, 4, None) == (1, 4096)  # not a GPU


def test_leading_dims_a_strided_input_and_bad_words():
    scheme = IntWeights(4, 32, False)
    packed, scale, zero = packed_weight(64, 96, scheme, seed=3)
    wide = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(4))
    out = int_linear.matmul(wide[..., 32:].to(DEVICE), *on_device(packed, scale, zero), scheme).cpu()
    assert out.shape == (2, 5, 64)
    expected = oracle(wide[..., 32:].reshape(10, 96), packed, scale, zero, scheme, 96)
    assert (out.reshape(10, 64) - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    with pytest.raises(ValueError, match="int32 words"):
        int_linear.matmul(torch.zeros(1, 100), *on_device(packed, scale, zero), scheme)


def test_greedy_through_the_integer_gemm_equals_the_oracle(tmp_path, tokenizers_by_kind, monkeypatch):
    """A W4A16 Qwen3 with zero points built as on a GPU (its dense projections kept packed)
    generates the same tokens with every projection through the kernels (decode steps tiled and
    split over K, prefills' weights dequantized first) as through the dequantized oracle (the CPU path)."""
    pytest.importorskip("compressed_tensors")
    hf = write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    pack_checkpoint(tmp_path, 4, False, 16)
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = generation_prompts(hf.config.vocab_size)[:3]

    def greedy(project) -> list[list[int]]:
        monkeypatch.setattr(Linear, "project", project)
        llm = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "cuda_graph_max_batch": 0})
        paths.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    def oracle(self, x, bias=None):
        assert self.ints is not None
        return F.linear(x, self.dequantized(x.dtype), bias)

    def fused(self, x, bias=None):
        paths.append(int_linear.path_for(x.reshape(-1, x.shape[-1]).shape[0], x))
        out = self.fused(x)
        return out if bias is None else out + bias

    paths, splits, kernel = [], [], int_linear._int_matmul_kernel
    reference = greedy(oracle)
    monkeypatch.setattr(int_linear, "PREFILL_TOKENS", len(prompts) + 1)
    monkeypatch.setattr(split_k, "MIN_SPLIT_STEPS", 1)
    monkeypatch.setattr(split_k, "SUMS_SHARE", 0)
    monkeypatch.setattr(split_k, "multiprocessors", lambda device: 64)

    class Counted:  # each launch's splits (its grid's third axis)
        def __getitem__(self, grid):
            splits.append(grid[2])
            return kernel[grid]

    monkeypatch.setattr(int_linear, "_int_matmul_kernel", Counted())
    assert greedy(fused) == reference and set(paths) == set(int_linear.PATHS) and max(splits) > 1
