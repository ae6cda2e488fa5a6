"""The fused-MoE Triton kernels (`model/fused_moe.py`) against the torch oracle
(`moe.experts_reference`), and whole Mixtral and GPT-OSS checkpoints' greedy output through them; the
kernels run under Triton's interpreter on CPU, compiled on CUDA where it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine import fp8  # noqa: E402
from splitserve.engine.mxfp4 import Packed, dequantize  # noqa: E402
from splitserve.engine.model import expert_dequantize, fp8_w8a8, fused_moe  # noqa: E402
from splitserve.engine.model.moe import Experts, GatedAct, experts_reference, route  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.hf_checkpoints import (  # noqa: E402,F401 (fixture)
    ENGINE_ARGS, generation_prompts, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.test_fp8 import quantize_checkpoint  # noqa: E402
from tests.engine.test_mxfp4 import packed, quantize_experts  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2}
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's tl.dot misreads bfloat16


def problem(tokens: int, experts: int, top_k: int, hidden: int, width: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g) * 0.2).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, width", [
    (1, 8, 2, 64, 32),     # one decode: most experts idle, tiles past the last group exit
    (5, 4, 2, 48, 80),     # neither hidden nor width a multiple of the tiles
    (3, 8, 8, 32, 16),     # every expert for every token (top-k = all)
    (40, 16, 1, 64, 32),   # top-1
    (70, 4, 2, 32, 96)])   # more than a 16-row tile per expert
@pytest.mark.parametrize("block_m", fused_moe.BLOCK_M_SIZES)
def test_fused_experts_equal_the_oracle(tokens, experts, top_k, hidden, width, block_m):
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, width)
    out = fused_moe.fused_experts(*on_device(x, w13, w2, weights, ids), block_m=block_m)
    torch.testing.assert_close(out.cpu(), experts_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_half_precision_and_strided_rows():
    """float16 activations and weights (float32 accumulation), x a column slice of wider rows."""
    x, w13, w2, weights, ids = problem(9, 8, 2, 32, 48, dtype=torch.float16, seed=1)
    wide = torch.cat([torch.zeros(9, 16, dtype=torch.float16), x], dim=1)
    out = fused_moe.fused_experts(*on_device(wide[:, 16:], w13, w2, weights, ids))
    expected = experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("limit", [2.0, None], ids=["clamped", "unclamped"])
def test_gpt_oss_experts_equal_the_oracle(limit):
    """GPT-OSS's experts: gate and up rows interleaved, with biases, the clamped SwiGLU (its limit
    binds for some of these values), and down biases weighted as each expert's output is."""
    x, w13, w2, weights, ids = problem(20, 4, 2, 32, 48)
    g = torch.Generator().manual_seed(1)
    b13, b2 = torch.randn(4, 96, generator=g), torch.randn(4, 32, generator=g)
    act = GatedAct(interleaved=True, alpha=1.702, limit=limit)
    assert (torch.einsum("th,eoh->teo", x, w13) + b13).abs().max() > 2.0
    out = fused_moe.fused_experts(*on_device(x, w13, w2, weights, ids), act=act, b13=b13.to(DEVICE), b2=b2.to(DEVICE))
    expected = experts_reference(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    # the down biases, weighted: what the output would miss without them (each token's weights sum to 1)
    without = experts_reference(x, w13, w2, weights, ids, act, b13)
    torch.testing.assert_close(expected - without, (weights[..., None] * b2[ids]).sum(dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("act", [GatedAct(), GatedAct(interleaved=True, alpha=1.702, limit=7.0)],
                         ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("tokens, block_m", [(3, 16), (40, 64)])
def test_mxfp4_experts_equal_the_dequantized_oracle(dtype, act, tokens, block_m):
    """Experts kept as MXFP4 bytes compute what their dequantized weights do: every code, scales
    from 2**-11 to 2**-3, hidden and width of several groups, 8 experts of which some idle."""
    experts, hidden, width = 8, 96, 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    halves = [packed((experts, rows, cols // 32), seed) for seed, rows, cols in ((4, 2 * width, hidden),
                                                                                   (5, hidden, width))]
    w13, w2 = (Packed(blocks, scales - 8, dtype) for blocks, scales in halves)
    b13, b2 = (torch.randn(experts, n, generator=g).to(dtype) if act.interleaved else None for n in (2 * width, hidden))
    weights, ids = route(torch.randn(tokens, experts, generator=g), 2, renormalize=True)
    expected = experts_reference(x, w13, w2, weights, ids, act, b13, b2)
    dense = [dequantize(w.blocks, w.scales, dtype) for w in (w13, w2)]
    assert torch.equal(expected, experts_reference(x, *dense, weights, ids, act, b13, b2))
    out = fused_moe.fused_experts(*on_device(x), *(Packed(w.blocks.to(DEVICE), w.scales.to(DEVICE), dtype)
                                                   for w in (w13, w2)), *on_device(weights, ids), block_m, act,
                                  *on_device(b13), b2=on_device(b2)[0])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def fp8_stack(experts: int, rows: int, cols: int, block: tuple[int, int], seed: int) -> tuple:
    """FP8 codes [experts, rows, cols] and block scales, each expert quantized in `block`s."""
    g = torch.Generator().manual_seed(seed)
    codes = fp8.quantize(torch.randn(experts, rows, cols, generator=g), None)[0]
    grid = (-(-rows // block[0]), -(-cols // block[1]))  # a scale per block: weights of 0 to 0.9, blocks apart
    scales = torch.rand(experts, *grid, generator=g) * 2.0 ** torch.randint(-13, -9, (experts, *grid), generator=g)
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("block", [(32, 32), (64, 32), (32, 64), fp8.ROWS])
@pytest.mark.parametrize("tokens, block_m", [(3, 16), (40, 64)])
def test_fp8_experts_equal_the_dequantized_oracle(dtype, block, tokens, block_m):
    """Experts kept as FP8 codes compute what their dequantized weights do: block scales of rows
    and columns (the last ones partial: hidden 96 in 64s), or one scale a row; 8 experts of which
    some idle."""
    experts, hidden, width = 8, 96, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = (fp8.Stacked(*fp8_stack(experts, rows, cols, block, seed), block, dtype)
               for seed, rows, cols in ((6, 2 * width, hidden), (7, hidden, width)))
    weights, ids = route(torch.randn(tokens, experts, generator=g), 2, renormalize=True)
    expected = experts_reference(x, w13, w2, weights, ids)
    dense = [torch.stack([w[e] for e in range(experts)]) for w in (w13, w2)]
    assert torch.equal(expected, experts_reference(x, *dense, weights, ids))
    out = fused_moe.fused_experts(*on_device(x), *(fp8.Stacked(w.weight.to(DEVICE), w.scale.to(DEVICE), block, dtype)
                                                   for w in (w13, w2)), *on_device(weights, ids), block_m)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def quantized_values(rows: torch.Tensor) -> torch.Tensor:
    """Activations as W8A8 multiplies them: their e4m3 codes times their group scales (float32)."""
    codes, scales = fp8_w8a8.quantize_reference(rows)
    return codes.float() * scales.t().repeat_interleave(fp8_w8a8.GROUP, 1)[:, :rows.shape[1]]


def w8a8_reference(x, w13, w2, weights, ids, act=GatedAct(), b13=None, b2=None) -> torch.Tensor:
    """`experts_reference` with x, and each assignment's gated activations (rounded to x's dtype,
    as the gate-up kernel stores them), quantized as the W8A8 kernels take them."""
    out, top_k, flat, values = torch.zeros_like(x), ids.shape[1], ids.flatten(), quantized_values(x)
    for e in range(w13.shape[0]):
        assignments = (flat == e).nonzero().flatten()
        if not len(assignments):
            continue
        tokens = assignments // top_k
        gate, up = act.split(F.linear(values[tokens], w13[e].float(), None if b13 is None else b13[e].float()))
        gated = quantized_values(act(gate, up).to(x.dtype))
        down = F.linear(gated, w2[e].float(), None if b2 is None else b2[e].float())
        out.index_add_(0, tokens, (down * weights.flatten()[assignments, None]).to(x.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("block, act, width", [
    ((128, 128), GatedAct(), 256),   # gate's and up's tiles each in one block of rows: a scale a tile a k step
    ((128, 128), GatedAct(), 160),   # up's rows start mid-block (each row's scale); the width a group and a part
    ((32, 128), GatedAct(), 160),    # blocks of fewer rows than a tile's
    (fp8.ROWS, GatedAct(), 160),     # one scale a row
    ((128, 128), GatedAct(interleaved=True, alpha=1.702, limit=7.0), 160)], ids=["tile", "rows", "32", "row", "oss"])
# the 16-row tile, and the 128-row one (the only one prefills take: from 1024 assignments of 8 experts)
@pytest.mark.parametrize("tokens, block_m", [(3, None), (130, 128)])
def test_fp8_experts_w8a8_equal_the_oracle_of_their_quantized_activations(dtype, block, act, width, tokens, block_m):
    """W8A8 experts (x and the gated activations quantized per token and 128 columns, codes times
    codes) compute what the dequantized weights do on the activations so quantized (hidden 256);
    and land within the activations' e4m3 rounding of the W8A16 oracle."""
    experts, hidden = 8, 256
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = (fp8.Stacked(*fp8_stack(experts, rows, cols, (1, cols) if block == fp8.ROWS else block, seed),
                           block, dtype) for seed, rows, cols in ((6, 2 * width, hidden), (7, hidden, width)))
    b13, b2 = (torch.randn(experts, n, generator=g).to(dtype) * 0.1 if act.interleaved else None
               for n in (2 * width, hidden))
    weights, ids = route(torch.randn(tokens, experts, generator=g), 4, renormalize=True)
    out = fused_moe.fused_experts(*on_device(x), *(to_device(w) for w in (w13, w2)), *on_device(weights, ids),
                                  block_m=block_m, act=act, b13=on_device(b13)[0], w8a8=True,
                                  b2=on_device(b2)[0]).cpu()
    expected = w8a8_reference(x, w13, w2, weights, ids, act, b13, b2)
    # a gated value within float error of an e4m3 rounding boundary may take the other code: a few
    # elements of the output differ by a step of the gated activations' codes, the rest by float error
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    close = (out - expected).abs() <= tol * (expected.abs().max() + expected.abs())
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert close.float().mean().item() > 0.99 and error < (1e-3 if dtype == torch.float32 else 2e-2)
    exact = experts_reference(x, w13, w2, weights, ids, act, b13, b2).float()
    assert 1e-3 < ((out.float() - exact).norm() / exact.norm()).item() < 0.06


def test_prefills_of_fp8_experts_run_w8a8_where_the_gpu_has_fp8_tensor_cores(monkeypatch):
    """From DEQUANTIZE_ASSIGNMENTS an expert, W8A8 where `fp8_w8a8.supported` (no dequantization),
    else the stack dequantized first; below it, the codes widened in the kernels (`path_for` names each)."""
    experts, hidden, width = 4, 128, 128
    g = torch.Generator().manual_seed(3)
    w13, w2 = (to_device(fp8.Stacked(*fp8_stack(experts, rows, cols, (128, 128), seed), (128, 128), torch.float32))
               for seed, rows, cols in ((1, 2 * width, hidden), (2, hidden, width)))
    quantized, dequantized = [], []
    real_quantize, real_dequantize = fp8_w8a8.quantize, expert_dequantize.dequantize_experts
    monkeypatch.setattr(fp8_w8a8, "quantize", lambda rows: quantized.append(rows.shape) or real_quantize(rows))
    monkeypatch.setattr(expert_dequantize, "dequantize_experts",
                        lambda *a: dequantized.append(1) or real_dequantize(*a))
    monkeypatch.setattr(fused_moe, "DEQUANTIZE_ASSIGNMENTS", {**fused_moe.DEQUANTIZE_ASSIGNMENTS, "fp8": 4})
    for tokens, fp8_cores, path in [(8, True, "w8a8"), (8, False, "dequantized"), (7, True, "as read")]:
        monkeypatch.setattr(fp8_w8a8, "supported", lambda device, block: fp8_cores)
        quantized.clear(), dequantized.clear()
        x = torch.randn(tokens, hidden, generator=g)
        weights, ids = route(torch.randn(tokens, experts, generator=g), 2, renormalize=True)
        fused_moe.fused_experts(*on_device(x), w13, w2, *on_device(weights, ids))
        assert (len(quantized), bool(dequantized)) == {"w8a8": (2, False), "dequantized": (0, True),
                                                      "as read": (0, False)}[path], tokens
        assert fused_moe.path_for("fp8", ids.numel(), experts, x, w13.block) == path
    with pytest.raises(ValueError, match="whole 128-column groups"):
        fused_moe.fused_experts(*on_device(x), *(to_device(fp8.Stacked(*fp8_stack(experts, r, c, (32, 32), 0),
                                                                       (32, 32), torch.float32))
                                                 for r, c in ((2 * width, hidden), (hidden, width))),
                                *on_device(weights, ids), w8a8=True)


def quantized_stacks(fmt: str, experts: int, hidden: int, width: int, dtype: torch.dtype) -> tuple:
    """(w13, w2) as MXFP4 bytes (scales from 2**-11 to 2**-3) or FP8 codes in 32 x 32 blocks."""
    shapes = ((2 * width, hidden), (hidden, width))
    if fmt == "mxfp4":
        return tuple(Packed(blocks, scales - 8, dtype) for blocks, scales in
                     (packed((experts, rows, cols // 32), seed) for seed, (rows, cols) in enumerate(shapes)))
    return tuple(fp8.Stacked(*fp8_stack(experts, rows, cols, (32, 32), seed), (32, 32), dtype)
                 for seed, (rows, cols) in enumerate(shapes))


def to_device(w):
    if isinstance(w, Packed):
        return Packed(w.blocks.to(DEVICE), w.scales.to(DEVICE), w.dtype)
    return fp8.Stacked(w.weight.to(DEVICE), w.scale.to(DEVICE), w.block, w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_a_stack_dequantizes_on_the_device_as_its_oracle_does(fmt, dtype):
    """Bit for bit, a slice of experts at a time (the interpreter truncates float32 to bfloat16
    where a GPU rounds to nearest, so bfloat16 is checked on CUDA)."""
    w13, _ = quantized_stacks(fmt, 8, 96, 64, dtype)
    out = expert_dequantize.dequantize_experts(to_device(w13), 2, 5, dtype).cpu()
    assert out.shape == (5, 128, 96) and torch.equal(out, torch.stack([w13[e] for e in range(2, 7)]))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("act", [GatedAct(), GatedAct(interleaved=True, alpha=1.702, limit=7.0)],
                         ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("tokens", [40, 520])  # 10 and 130 assignments an expert: the 16- and 128-row tiles
def test_quantized_experts_dequantized_a_chunk_at_a_time_equal_the_oracle(monkeypatch, fmt, dtype, act, tokens):
    """A stack dequantized first, a chunk of experts at a time (one launch of each kernel a chunk,
    each running only its experts' tiles), computes what the dequantized weights do."""
    experts, hidden, width = 8, 96, 64
    w13, w2 = quantized_stacks(fmt, experts, hidden, width, dtype)
    monkeypatch.setattr(expert_dequantize, "DEQUANTIZE_BYTES", 3 * 2 * width * hidden * dtype.itemsize)
    chunks, real = [], expert_dequantize.dequantize_experts
    monkeypatch.setattr(expert_dequantize, "dequantize_experts", lambda w, first, count, dt: chunks.append(
        (w.shape[1], first, count)) or real(w, first, count, dt))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    b13, b2 = (torch.randn(experts, n, generator=g).to(dtype) if act.interleaved else None for n in (2 * width, hidden))
    weights, ids = route(torch.randn(tokens, experts, generator=g), 2, renormalize=True)
    out = fused_moe.fused_experts(*on_device(x), to_device(w13), to_device(w2), *on_device(weights, ids), None, act,
                                  *on_device(b13), dequantize_first=True, b2=on_device(b2)[0])
    # w13's experts [128, 96] in chunks of 3; w2's [96, 64], half the size, of 6
    assert chunks == [(2 * width, 0, 3), (2 * width, 3, 3), (2 * width, 6, 2), (hidden, 0, 6), (hidden, 6, 2)]
    expected = experts_reference(x, w13, w2, weights, ids, act, b13, b2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def test_quantized_stacks_dequantize_from_their_formats_load_per_expert():
    """From DEQUANTIZE_ASSIGNMENTS an expert on average (MXFP4 sooner than FP8); tensors never."""
    x = torch.empty(1)
    for fmt, per_expert in fused_moe.DEQUANTIZE_ASSIGNMENTS.items():
        assert fused_moe.dequantizes(fmt, per_expert * 32, 32, x)
        assert not fused_moe.dequantizes(fmt, per_expert * 32 - 1, 32, x)
    assert fused_moe.DEQUANTIZE_ASSIGNMENTS["mxfp4"] < fused_moe.DEQUANTIZE_ASSIGNMENTS["fp8"]
    assert not fused_moe.dequantizes("dense", 1 << 20, 32, x)
    assert fused_moe.path_for("dense", 1 << 20, 32, x, None, dequantize_first=True) == "as read"
    assert fused_moe.path_for("mxfp4", 1, 32, x, None, dequantize_first=True) == "dequantized"
    assert fused_moe.path_for("fp8", 1, 32, x, (128, 128), w8a8=True) == "w8a8"
    # gpt-oss-120b's w13 (128 experts of 5760 x 2880, bf16): 32 experts a GiB chunk
    w13 = torch.empty((128, 5760, 2880), device="meta")
    assert expert_dequantize.expert_chunks(w13, torch.bfloat16) == [(0, 32), (32, 32), (64, 32), (96, 32)]


def test_packed_and_dense_stacks_do_not_mix():
    x, w13, w2, weights, ids = problem(2, 4, 2, 32, 32)
    with pytest.raises(ValueError, match=r"in one format \(tensors, MXFP4, FP8 or packed integers\)"):
        fused_moe.fused_experts(x, Packed(*packed((4, 64, 1), 0), torch.float32), w2, weights, ids)


def test_all_tokens_on_one_expert_and_no_tokens():
    x, w13, w2, weights, _ = problem(33, 4, 1, 32, 16, seed=2)
    ids = torch.full((33, 1), 3)
    out = fused_moe.fused_experts(*on_device(x, w13, w2, weights, ids))
    torch.testing.assert_close(out.cpu(), experts_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    empty = fused_moe.fused_experts(*on_device(x[:0], w13, w2, weights[:0], ids[:0]))
    assert empty.shape == (0, 32)


def test_the_block_size_follows_the_load_per_expert():
    assert fused_moe.block_m_for(8 * 1, 128) == 16       # one decode of Qwen3-30B-A3B
    assert fused_moe.block_m_for(8 * 256, 128) == 16     # 256 decodes: 16 per expert
    assert fused_moe.block_m_for(8 * 1024, 128) == 64    # a 1k prefill: 64 per expert
    assert fused_moe.block_m_for(8 * 2048, 128) == 128   # a 2k prefill: 128 per expert
    assert fused_moe.block_m_for(8 * 2048, 128, tensors=False) == 64  # as stored: 64 rows at most
    assert fused_moe.block_m_for(2 * 2048, 8) == 128     # Mixtral


def test_launch_shapes_per_tile_and_format():
    """Tensors' prefill tiles take 64-wide k steps, the 128-row one 8 warps and 128 columns of
    down; stacks read as stored keep their tiles and never take the 128-row one; warm-up runs every
    (tile, dequantized first) a serving step may, dequantized only where a step reaches it."""
    assert fused_moe.launch_config(16, "dense") == (64, 64, 32, 4)
    assert fused_moe.launch_config(64, "dense") == (64, 64, 64, 4)
    assert fused_moe.launch_config(128, "dense") == (64, 128, 64, 8)
    assert fused_moe.launch_config(64, "mxfp4") == (32, 64, 32, 4) and fused_moe.launch_config(64, "fp8")[0] == 64
    with pytest.raises(ValueError, match="the 128-row tile reads tensors"):
        fused_moe.launch_config(128, "fp8")
    assert fused_moe.warm_up_tiles("dense") == fused_moe.warm_up_tiles("dense", 1) == \
        [(16, False), (64, False), (128, False)]
    assert fused_moe.warm_up_tiles("mxfp4") == fused_moe.warm_up_tiles("mxfp4", 32) == \
        [(16, False), (64, False), (64, True), (128, True)]  # dequantized from 32 an expert: both tensor tiles
    assert fused_moe.warm_up_tiles("fp8") == [(16, False), (64, False), (128, True)]  # from 128: the 128-row one
    assert fused_moe.warm_up_tiles("fp8", 127.9) == fused_moe.warm_up_tiles("mxfp4", 31) == [(16, False), (64, False)]


@pytest.mark.parametrize("name, kept", [("mixtral_moe", None), ("gpt_oss", None), ("gpt_oss", "mxfp4"),
                                        ("qwen3_moe", "fp8")])
def test_greedy_through_the_kernels_equals_the_oracle(tmp_path, tokenizers_by_kind, monkeypatch, name, kept):
    """A Mixtral and a GPT-OSS checkpoint written by transformers (and a GPT-OSS with its experts
    in MXFP4, kept packed, and a Qwen3-MoE in FP8, its experts kept FP8) generate the same tokens
    with their experts run by the fused kernels and their attention (GPT-OSS's sinks and window)
    by the Triton kernels as by the torch oracles (what the CPU engine runs), on the device the
    kernels run on (CUDA where it is); quantized experts are dequantized first in prefills."""
    hf = write_checkpoint(tmp_path, name, tokenizers_by_kind)
    if kept == "mxfp4":
        quantize_experts(tmp_path, width=64, scale_shift=-5)
    elif kept == "fp8":
        quantize_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = generation_prompts(hf.config.vocab_size)[:3]

    def greedy(backend="torch"):
        llm = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type}, attention_backend=backend)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    def oracle(self, x, weights, experts):
        return experts_reference(x, *self.stacks(x.dtype), weights, experts, self.act, self.b13, self.down_biases)

    monkeypatch.setattr(Experts, "forward", oracle)
    reference = greedy()
    calls = []

    def fused(self, x, weights, experts):
        assert self.format == kept
        calls.append(x.shape[0])
        return self.fused(x, weights, experts)

    monkeypatch.setattr(Experts, "forward", fused)
    # quantized experts dequantized for more assignments than a decode step's 3 tokens x top 2 make
    monkeypatch.setattr(fused_moe, "DEQUANTIZE_ASSIGNMENTS", {"mxfp4": 2, "fp8": 1})
    widened, real = [], expert_dequantize.dequantize_experts
    monkeypatch.setattr(expert_dequantize, "dequantize_experts", lambda *args: widened.append(1) or real(*args))
    assert greedy("triton") == reference
    assert calls and max(calls) > 1 and min(calls) >= 1
    assert bool(widened) == (kept is not None)
