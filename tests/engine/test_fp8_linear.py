"""The FP8 W8A16 GEMM (`model/fp8_linear.py`) against the torch oracle (the codes dequantized by
`fp8.dequantize`, then `F.linear`), and a whole FP8 checkpoint's greedy output with its dense
projections through it; the kernel runs under Triton's interpreter on CPU, compiled on CUDA where
it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine import fp8  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine.model import fp8_linear, fp8_w8a8, split_k  # noqa: E402
from splitserve.engine.model.linear import Linear  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.hf_checkpoints import (  # noqa: E402,F401 (fixture)
    ENGINE_ARGS, generation_prompts, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.test_fp8 import quantize_checkpoint  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's tl.dot misreads bfloat16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a weight whose blocks differ in scale by up to 16x (so a code read with
    another block's scale is far off)."""
    g = torch.Generator().manual_seed(seed)
    spread = 2.0 ** torch.randint(-2, 3, (-(-n // block[0]), -(-k // block[1])), generator=g).float()
    values = torch.randn(n, k, generator=g) * spread.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[
        :, :k]
    return fp8.quantize(values, block)


def oracle(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return F.linear(x.float(), fp8.dequantize(codes, scales, block, x.dtype).float())


def check(x, codes, scales, block):
    out = fp8_linear.matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), block).cpu()
    expected = oracle(x, codes, scales, block)
    assert out.dtype == x.dtype and out.shape == expected.shape
    scale = expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[x.dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("n, k, block", [
    (96, 64, (32, 32)),      # whole blocks, 32-wide k tiles
    (70, 100, (32, 32)),     # the last row and column of blocks partial
    (200, 320, (128, 128)),  # Qwen's and DeepSeek's blocks (64-wide k tiles), partial both ways
    (48, 128, (16, 64))])    # blocks of fewer rows than a tile's columns
@pytest.mark.parametrize("tokens", [1, 5, 17, 70])  # each tile shape: 16, 64 and 128 rows
def test_the_fp8_gemm_equals_the_dequantized_oracle(dtype, n, k, block, tokens):
    codes, scales = weight(n, k, block, seed=n + tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    check(x, codes, scales, block)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("tokens", [1, 20, 70])
def test_one_scale_a_row(dtype, tokens):
    """`fp8.ROWS`: each row's one scale spans its 100 columns (no whole 32s: the last k tile masked)."""
    g = torch.Generator().manual_seed(tokens)
    values = torch.randn(48, 100, generator=g) * 2.0 ** torch.randint(-2, 3, (48, 1), generator=g).float()
    codes, scales = fp8.quantize(values, (1, 100))
    assert scales.shape == (48, 1)
    x = torch.randn(tokens, 100, generator=g).to(dtype)
    check(x, codes, scales, fp8.ROWS)


def test_strided_rows_and_leading_dims():
    """x a column slice of wider rows, and inputs with more leading dims."""
    codes, scales = weight(64, 96, (32, 32), seed=1)
    wide = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    check(wide[:, 32:], codes, scales, (32, 32))
    batched = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(3))
    out = fp8_linear.matmul(batched.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), (32, 32)).cpu()
    torch.testing.assert_close(out, oracle(batched.reshape(6, 96), codes, scales, (32, 32)).view(2, 3, 64),
                               atol=1e-5, rtol=1e-5)


def test_no_tokens_and_bad_operands():
    codes, scales = weight(64, 64, (32, 32), seed=4)
    assert fp8_linear.matmul(torch.empty(0, 64), codes, scales, (32, 32)).shape == (0, 64)
    with pytest.raises(ValueError, match="whole 32-column k tiles"):
        fp8_linear.matmul(torch.randn(1, 64), codes, scales, (32, 48))
    with pytest.raises(ValueError, match=r"64 input features got inputs of shape \(2, 32\)"):
        fp8_linear.matmul(torch.randn(2, 32), codes, scales, (32, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn codes"):
        fp8_linear.matmul(torch.randn(1, 64), codes.float(), scales, (32, 32))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("n, k, block", [
    (96, 320, (32, 32)),     # ten 32-wide k tiles
    (200, 320, (128, 128)),  # five 64-wide k tiles, partial blocks both ways
    (48, 100, fp8.ROWS)])    # one scale a row: the last split's k tile masked
@pytest.mark.parametrize("tokens", [1, 5, 40])  # the 16- and 64-row tiles
@pytest.mark.parametrize("splits", [2, 3, 16])  # even, uneven (the last split shorter), more than k tiles
def test_a_decode_tile_split_over_k_equals_the_oracle(dtype, n, k, block, tokens, splits):
    """Each split's float32 sums added by the tile's last split, its counters put back to 0."""
    codes, scales = weight(n, k, block, seed=n + splits) if block != fp8.ROWS else fp8.quantize(
        torch.randn(n, k, generator=torch.Generator().manual_seed(splits)), (1, k))
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    out = fp8_linear.matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), block, splits=splits).cpu()
    expected = oracle(x, codes, scales, block)
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()
    assert not split_k.counters(DEVICE).any()


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("n, k, block", [
    (70, 100, (32, 32)),     # the last row and column of blocks partial
    (200, 320, (128, 128)),  # 64-wide k tiles, partial both ways
    (48, 128, (16, 64)),     # blocks of fewer rows than a program's
    (70, 100, fp8.ROWS)])    # one scale a row
def test_the_device_dequantization_equals_fp8_dequantize(dtype, n, k, block):
    """Bit for bit: each code times its block's scale in float32, rounded once (the interpreter
    truncates float32 to bfloat16 where a GPU rounds to nearest, so bfloat16 is checked on CUDA)."""
    codes, scales = weight(n, k, block, seed=n) if block != fp8.ROWS else fp8.quantize(
        torch.randn(n, k, generator=torch.Generator().manual_seed(n)), (1, k))
    out = fp8_linear.dequantize(codes.to(DEVICE), scales.to(DEVICE), block, dtype).cpu()
    assert torch.equal(out, fp8.dequantize(codes, scales, None if block == fp8.ROWS else block, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_from_prefill_tokens_the_weight_is_dequantized_once_or_the_activations_quantized(monkeypatch, dtype):
    """Fewer tokens run the tiled kernel; from PREFILL_TOKENS one dequantization of the weight, then
    torch's matmul (the oracle's own product), or W8A8 where the device has FP8 tensor cores
    (`path` forces any of them)."""
    codes, scales = weight(200, 384, (128, 128), seed=5)
    launches = {"tiled": [], "dequantized": [], "w8a8": []}
    monkeypatch.setattr(fp8_linear, "PREFILL_TOKENS", 8)
    dequantize, kernel, w8a8 = fp8_linear.dequantize, fp8_linear._fp8_matmul_kernel, fp8_w8a8.matmul
    monkeypatch.setattr(fp8_linear, "dequantize",
                        lambda *args: launches["dequantized"].append(1) or dequantize(*args))
    monkeypatch.setattr(fp8_w8a8, "matmul", lambda *args: launches["w8a8"].append(1) or w8a8(*args))

    class Counted:
        def __getitem__(self, grid):
            launches["tiled"].append(1)
            return kernel[grid]

    monkeypatch.setattr(fp8_linear, "_fp8_matmul_kernel", Counted())
    for tokens, path, fp8_cores, taken in [(7, None, True, "tiled"), (8, None, False, "dequantized"),
                                           (8, None, True, "w8a8"), (1, "dequantized", False, "dequantized"),
                                           (2, "w8a8", False, "w8a8"), (70, "tiled", True, "tiled")]:
        monkeypatch.setattr(fp8_w8a8, "supported", lambda device, block: fp8_cores)
        for calls in launches.values():
            calls.clear()
        x = torch.randn(tokens, 384, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        out = fp8_linear.matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), (128, 128), path=path).cpu()
        assert {name: len(calls) for name, calls in launches.items()} == {
            name: int(name == taken) for name in launches}, (tokens, path)
        if taken == "w8a8":
            expected = fp8_w8a8.reference(x, codes, scales, (128, 128))
        else:
            expected = oracle(x, codes, scales, (128, 128))
        assert (out.double() - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()


def test_prefills_path_follows_the_device_and_the_blocks(monkeypatch):
    x = torch.zeros(1, 32)
    big = fp8_linear.PREFILL_TOKENS
    assert fp8_linear.path_for(big - 1, x, (128, 128)) == "tiled"
    assert fp8_linear.path_for(big, x, (128, 128)) == "dequantized"  # the CPU has no FP8 tensor cores
    monkeypatch.setattr(fp8_w8a8, "capability", lambda device: (9, 0))
    cuda = torch.device("cuda", 0)
    assert fp8_w8a8.supported(cuda, (128, 128)) and fp8_w8a8.supported(cuda, fp8.ROWS)
    assert not fp8_w8a8.supported(cuda, (128, 64))  # a k step would straddle two blocks of columns
    monkeypatch.setattr(fp8_w8a8, "capability", lambda device: (8, 0))
    assert not fp8_w8a8.supported(cuda, (128, 128))  # an A100: no FP8 tensor cores
    with pytest.raises(ValueError, match="path must be one of tiled, dequantized, w8a8"):
        fp8_linear.matmul(x, *weight(16, 32, (16, 32), seed=1), (16, 32), path="fast")


def test_splits_fill_the_multiprocessors():
    """Each split long enough that its float32 sums are at most a quarter of the codes it reads
    (the 64-row tile: 16 k tiles of 64; `split_k.split_count`)."""
    # Llama-3-8B's o_proj on an H100 (32 tiles of 128 outputs; 64 k tiles of 64): 8 splits of 512
    # columns for up to 16 tokens, 4 of 1024 for up to 64, whatever the tokens within a tile
    plans = {tokens: fp8_linear.split_plan(tokens, 4096, 4096, (128, 128), 132) for tokens in (1, 16, 17, 64, 65)}
    assert plans == {1: (8, 512), 16: (8, 512), 17: (4, 1024), 64: (4, 1024), 65: (1, 4096)}


def test_tiles_follow_the_token_count():
    assert fp8_linear.tile_for(1) == fp8_linear.tile_for(16) == (16, 128, 4, True)  # decode batches
    assert fp8_linear.tile_for(64) == (64, 128, 4, True)
    assert fp8_linear.tile_for(8192) == (128, 128, 8, False)  # prefills: never split
    assert fp8_linear.block_k_for((128, 128)) == fp8_linear.block_k_for(fp8.ROWS) == 64
    assert fp8_linear.block_k_for((32, 32)) == 32


@pytest.mark.parametrize("name, block, prefills", [("qwen3_qk_norm", 32, "dequantized"),
                                                   ("qwen3_qk_norm", None, "dequantized"),
                                                   ("qwen3_qk_norm", None, "w8a8"), ("qwen3_moe", 32, "dequantized"),
                                                   ("minimax_m2", 32, "dequantized")])
def test_greedy_through_the_fp8_gemm_equals_the_oracle(tmp_path, tokenizers_by_kind, monkeypatch, name, block,
                                                       prefills):
    """A Qwen3 (block-wise, and tensor-wise: kept one scale a row), a Qwen3-MoE and a MiniMax-M2
    (its experts named as Mixtral's, as in its FP8 release) FP8 checkpoint built as on an H100 (its
    dense projections and its experts kept FP8) generate the same tokens with every projection
    through the W8A16 kernel as through the dequantized oracle (what the CPU path runs), on the
    device the kernels run on (CUDA where it is), its decode tiles split over K (as short splits as
    can be, on a device of 64 multiprocessors), its prefills (more tokens than a decode step's) with
    their weights dequantized first, or W8A8 (whose oracle quantizes the activations in torch:
    `fp8_w8a8.reference`; one scale a row, blocks of whole groups)."""
    hf = write_checkpoint(tmp_path, name, tokenizers_by_kind)
    quantize_checkpoint(tmp_path, block)
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = generation_prompts(hf.config.vocab_size)[:3]

    def greedy():  # eager steps (no CUDA graphs), each step's projections counted from its first
        llm = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "cuda_graph_max_batch": 0})
        calls.clear()  # the engine's start-up ran projections of its own on CUDA (kernel warm-up)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    def oracle(self, x, bias=None):
        assert self.fp8_block is not None
        rows = x.reshape(-1, x.shape[-1])
        if prefills == "w8a8" and rows.shape[0] > len(prompts):
            out = fp8_w8a8.reference(rows, self.weight, self.weight_scale_inv, self.fp8_block).to(x.dtype)
            out = out.view(*x.shape[:-1], -1)
            return out if bias is None else out + bias
        return F.linear(x, fp8.dequantize(self.weight, self.weight_scale_inv, self.fp8_block, x.dtype), bias)

    monkeypatch.setattr(Linear, "project", oracle)
    calls = []
    reference = greedy()

    def fused(self, x, bias=None):
        assert self.fp8_block is not None
        calls.append(x.shape[0])
        out = self.fused(x)
        return out if bias is None else out + bias

    monkeypatch.setattr(Linear, "project", fused)
    monkeypatch.setattr(split_k, "MIN_SPLIT_STEPS", 1)
    monkeypatch.setattr(split_k, "SUMS_SHARE", 0)
    monkeypatch.setattr(split_k, "multiprocessors", lambda device: 64)
    monkeypatch.setattr(fp8_linear, "PREFILL_TOKENS", len(prompts) + 1)
    monkeypatch.setattr(fp8_w8a8, "supported", lambda device, block: prefills == "w8a8")
    splits, kernel, dequantize, w8a8, widened = [], fp8_linear._fp8_matmul_kernel, fp8_linear.dequantize, \
        fp8_w8a8.matmul, []
    monkeypatch.setattr(fp8_linear, "dequantize", lambda *args: widened.append("dequantized") or dequantize(*args))
    monkeypatch.setattr(fp8_w8a8, "matmul", lambda *args: widened.append("w8a8") or w8a8(*args))

    class Counted:  # each launch's splits (its grid's third axis)
        def __getitem__(self, grid):
            splits.append(grid[2])
            return kernel[grid]

    monkeypatch.setattr(fp8_linear, "_fp8_matmul_kernel", Counted())
    assert greedy() == reference
    assert max(splits) > 1 and widened and set(widened) == {prefills}
    assert calls and min(calls) == len(prompts) < max(calls)  # decode steps and prefills
