"""A sparse layer's experts from a packed integer checkpoint (W4A16 / W8A16, `int_weights`) kept as
its int32 words: the fused-MoE kernels reading them (`model/fused_moe.py`, `int_weight_tile`) against
the torch oracle (`moe.experts_reference` over `int_weights.Stacked`, which dequantizes as
compressed-tensors does: test_int_weights), as stored and dequantized a chunk of experts at a time;
a Qwen3-MoE checkpoint packed by compressed-tensors keeping its experts packed where built as on a
GPU (the CPU path dequantizes them at load), whole and over tensor-parallel ranks, giving
transformers' logits and, through the kernels, the oracle's tokens.
The kernels run under Triton's interpreter on CPU, compiled on CUDA where it is (the `kernels` mark)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine import fp8, int_weights  # noqa: E402
from splitserve.engine.int_weights import IntWeights  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.engine.model import expert_dequantize, fused_moe  # noqa: E402
from splitserve.engine.model.moe import Experts, SparseMoeBlock, experts_reference, route  # noqa: E402
from splitserve.engine.model.sharding import Shard  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.hf_checkpoints import (  # noqa: E402,F401 (fixture)
    ENGINE_ARGS, generation_prompts, hf_logits, prompt_ids, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.runner_helpers import max_diff  # noqa: E402
from tests.engine.test_fp8 import load, prefill_logits, reference  # noqa: E402
from tests.engine.test_fused_moe import DEVICE, HALF  # noqa: E402
from tests.engine.test_int_linear import packed_weight  # noqa: E402
from tests.engine.test_int_weights import gpu_build, pack_checkpoint  # noqa: E402,F401 (fixture)

pytestmark = pytest.mark.kernels
EXPERTS, HIDDEN, WIDTH = 8, 96, 64
# a group within a k tile (16), the tile's (32), across tiles (64, over 96 columns: one partial), a row's
SCHEMES = [IntWeights(4, 16, True), IntWeights(4, 32, False), IntWeights(8, 64, False), IntWeights(4, None, False),
           IntWeights(8, None, True)]


def int_stack(scheme: IntWeights, rows: int, cols: int, dtype: torch.dtype, seed: int,
              device: torch.device = torch.device("cpu")) -> int_weights.Stacked:
    """EXPERTS random packed weights [rows, cols] (`test_int_linear.packed_weight`) stacked, 8-bit
    ones' scales 16x smaller (float16 then holds the layer's output)."""
    parts = [packed_weight(rows, cols, scheme, seed=seed + e) for e in range(EXPERTS)]
    packed, scale = torch.stack([p[0] for p in parts]).to(device), torch.stack([p[1] for p in parts]).to(device)
    scale *= 16 / 2 ** scheme.bits
    zero = None if scheme.symmetric else torch.stack([p[2] for p in parts]).to(device)
    return int_weights.Stacked(packed, scale, zero, scheme, cols, dtype)


def stacks(scheme: IntWeights, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> tuple:
    return int_stack(scheme, 2 * WIDTH, HIDDEN, dtype, 1, device), int_stack(scheme, HIDDEN, WIDTH, dtype, 50, device)


def routed(tokens: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    return x, *route(torch.randn(tokens, EXPERTS, generator=g), 2, renormalize=True)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("tokens, block_m", [(3, 16), (40, 64)])
def test_packed_integer_experts_equal_the_dequantized_oracle(dtype, scheme, tokens, block_m):
    """Read as stored, 8 experts of which some idle: what their dequantized weights compute."""
    x, weights, ids = routed(tokens, dtype)
    w13, w2 = stacks(scheme, dtype)
    expected = experts_reference(x, w13, w2, weights, ids)
    dense = [torch.stack([w[e] for e in range(EXPERTS)]) for w in (w13, w2)]
    assert torch.equal(expected, experts_reference(x, *dense, weights, ids))
    out = fused_moe.fused_experts(x.to(DEVICE), *stacks(scheme, dtype, DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                                  block_m, dequantize_first=False)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=str)
def test_a_stack_dequantizes_on_the_device_as_its_oracle_does(scheme):
    w13, _ = stacks(scheme, torch.float32)
    device_w13, _ = stacks(scheme, torch.float32, DEVICE)
    out = expert_dequantize.dequantize_experts(device_w13, 2, 5, torch.float32).cpu()
    assert out.shape == (5, 2 * WIDTH, HIDDEN) and torch.equal(out, torch.stack([w13[e] for e in range(2, 7)]))


@pytest.mark.parametrize("tokens", [40, 520])  # 10 and 130 assignments an expert: the 16- and 128-row tiles
def test_prefills_dequantize_a_chunk_of_experts_at_a_time(monkeypatch, tokens):
    """From DEQUANTIZE_ASSIGNMENTS an expert (as FP8's), or forced: one launch of each kernel a chunk."""
    dtype, scheme = torch.float32, IntWeights(4, 32, False)
    assert fused_moe.DEQUANTIZE_ASSIGNMENTS["int"] == fused_moe.LARGE_TILE_ASSIGNMENTS
    assert fused_moe.path_for("int", 2 * tokens, EXPERTS, torch.empty(1), None) == (
        "dequantized" if tokens == 520 else "as read")
    monkeypatch.setattr(expert_dequantize, "DEQUANTIZE_BYTES", 3 * 2 * WIDTH * HIDDEN * dtype.itemsize)
    chunks, real = [], expert_dequantize.dequantize_experts
    monkeypatch.setattr(expert_dequantize, "dequantize_experts", lambda w, first, count, dt: chunks.append(
        (w.shape[1], first, count)) or real(w, first, count, dt))
    x, weights, ids = routed(tokens, dtype)
    out = fused_moe.fused_experts(x.to(DEVICE), *stacks(scheme, dtype, DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                                  dequantize_first=True)
    assert chunks == [(2 * WIDTH, 0, 3), (2 * WIDTH, 3, 3), (2 * WIDTH, 6, 2), (HIDDEN, 0, 6), (HIDDEN, 6, 2)]
    assert_close(out, experts_reference(x, *stacks(scheme, dtype), weights, ids), dtype)


def test_integer_stacks_do_not_mix_with_others_and_need_contiguous_rows():
    x, weights, ids = routed(2, torch.float32)
    w13, w2 = stacks(IntWeights(4, 32, True), torch.float32)
    with pytest.raises(ValueError, match="packed integers"):
        fused_moe.fused_experts(x, w13, torch.stack([w2[e] for e in range(EXPERTS)]), weights, ids)
    strided = int_weights.Stacked(w13.packed.transpose(1, 2).contiguous().transpose(1, 2), w13.scale, None,
                                  w13.scheme, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe.fused_experts(x, strided, w2, weights, ids)


def moe_checkpoint(path, tokenizers_by_kind, bits: int, symmetric: bool, group: int | None, dense=None):
    write_checkpoint(path, "qwen3_moe", tokenizers_by_kind)
    pack_checkpoint(path, bits, symmetric, group, dense=dense)


def sparse_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("bits, symmetric, group", [(4, True, 16), (4, False, 16), (8, False, None)])
def test_a_packed_moe_checkpoint_keeps_its_experts_packed(tmp_path, tokenizers_by_kind, monkeypatch, bits,
                                                           symmetric, group):
    """Built as on a GPU, every sparse layer holds the experts' words, scales and zero points (no
    expert in the serving dtype), and the model gives transformers' logits from the weights
    compressed-tensors decompresses (the CPU path multiplying each expert dequantized); built for
    the CPU path, the experts are dequantized at load."""
    pytest.importorskip("compressed_tensors")
    packed = tmp_path / "packed"
    packed.mkdir()
    moe_checkpoint(packed, tokenizers_by_kind, bits, symmetric, group, dense=tmp_path / "dense")
    assert all(b.experts.format is None for b in sparse_blocks(load(packed)))
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    engine = LLMEngine(str(packed), dtype="float32", **ENGINE_ARGS)
    blocks = sparse_blocks(engine.runner.model)
    for experts in (b.experts for b in blocks):
        assert experts.format == "int" and not hasattr(experts, "w13")
        assert experts.w13_packed.dtype == torch.int32 and (experts.w2_zero_point is None) == symmetric
        held = sum(p.numel() * p.element_size() for p in experts.parameters())
        dense = 2 * experts.num_experts * 3 * experts.width * experts.w2_packed.shape[1]  # float16's bytes
        assert held < dense * (bits + 3) / 16  # its bits, and under 3 a weight of scales and zero points
    hf = reference(tmp_path / "dense")
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    assert max_diff(prefill_logits(engine, ids), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("size, bits, symmetric, group", [(2, 4, False, 16), (4, 4, False, None), (2, 8, True, 16)])
def test_tensor_parallel_ranks_keep_packed_slices_that_add_up(tmp_path, tokenizers_by_kind, gpu_build, size, bits,
                                                              symmetric, group):
    """Each rank keeps every expert's slice of the width packed (gate's and up's rows, their zero
    points' words, down's columns in words and groups; a row's scale whole): the ranks' partial sums
    are the whole layer's."""
    pytest.importorskip("compressed_tensors")
    moe_checkpoint(tmp_path, tokenizers_by_kind, bits, symmetric, group)
    whole = sparse_blocks(load(tmp_path))[0]
    ranks = [sparse_blocks(load(tmp_path, Shard(rank, size)))[0] for rank in range(size)]
    assert all(rank.experts.format == "int" and rank.experts.width == whole.experts.width // size for rank in ranks)
    x = torch.randn(5, whole.experts.w2_packed.shape[1])
    assert max_diff(sum(rank(x) for rank in ranks), whole(x)) <= 1e-4


def test_a_width_that_cuts_a_group_is_dequantized_at_load(tmp_path, tokenizers_by_kind, gpu_build):
    """qwen3_moe's width (32) over 2 ranks in groups of 32: a slice would cut one, so the experts
    take the serving dtype and still add up."""
    pytest.importorskip("compressed_tensors")
    moe_checkpoint(tmp_path, tokenizers_by_kind, 4, True, 32)
    whole = sparse_blocks(load(tmp_path))[0]
    assert whole.experts.format == "int"
    ranks = [sparse_blocks(load(tmp_path, Shard(rank, 2)))[0] for rank in range(2)]
    assert all(rank.experts.format is None for rank in ranks)
    x = torch.randn(5, whole.experts.w2_packed.shape[1])
    assert max_diff(sum(rank(x) for rank in ranks), whole(x)) <= 1e-4


def test_greedy_through_the_kernels_equals_the_oracle(tmp_path, tokenizers_by_kind, gpu_build, monkeypatch):
    """A W4A16 Qwen3-MoE with zero points, built as on a GPU (dense projections packed too), gives the
    same tokens with its experts through the fused kernels (decode steps as stored, prefills
    dequantized first) as through the oracle (what the CPU engine runs)."""
    pytest.importorskip("compressed_tensors")
    moe_checkpoint(tmp_path, tokenizers_by_kind, 4, False, 16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = generation_prompts(load(tmp_path).config.vocab_size)[:3]

    def greedy() -> list[list[int]]:
        llm = LLM(str(tmp_path), **{**ENGINE_ARGS, "device": DEVICE.type, "cuda_graph_max_batch": 0})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    def oracle(self, x, weights, experts):
        return experts_reference(x, *self.stacks(x.dtype), weights, experts, self.act, self.b13, self.down_biases)

    monkeypatch.setattr(Experts, "forward", oracle)
    expected = greedy()
    paths = []

    def fused(self, x, weights, experts):
        assert self.format == "int"
        paths.append(fused_moe.path_for("int", x.shape[0] * experts.shape[1], self.num_experts, x, None))
        return self.fused(x, weights, experts)

    monkeypatch.setattr(Experts, "forward", fused)
    monkeypatch.setattr(fused_moe, "DEQUANTIZE_ASSIGNMENTS", {**fused_moe.DEQUANTIZE_ASSIGNMENTS, "int": 1})
    assert greedy() == expected and set(paths) == {"as read", "dequantized"}


def test_dummy_packed_experts_are_random_words(tmp_path, tokenizers_by_kind, gpu_build):
    """Dummy weights (`load_format: dummy`) for experts kept packed: random words and zero points at
    the dummy scale, spread about 0 like the dense dummies (as test_int_weights' projections)."""
    pytest.importorskip("compressed_tensors")
    from splitserve.engine.dummy_weights import init_dummy_weights
    from splitserve.engine.loader import load_model_config
    from splitserve.engine.model.llama import LlamaForCausalLM

    moe_checkpoint(tmp_path, tokenizers_by_kind, 4, False, 16)
    model = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64)
    init_dummy_weights(model, seed=3)
    experts = sparse_blocks(model)[0].experts
    assert experts.format == "int" and torch.all(experts.w2_scale == fp8.DUMMY_SCALE)
    values = torch.cat([w[e].flatten() for w in experts.stacks(torch.float32) for e in range(experts.num_experts)])
    assert abs(values.mean().item()) < 0.002 and 0.02 < values.std().item() < 0.03
