"""The fused elementwise kernels the model runs on CUDA (`model/triton_ops.py`) against the model's
torch code on the CPU (the gated activation against torch's own ops); the kernels run under
Triton's interpreter on CPU, compiled on CUDA where it is (the `kernels` mark)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine.config import ModelConfig  # noqa: E402
from splitserve.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.engine.model import moe_routing, triton_dispatch  # noqa: E402
from splitserve.engine.policies import ScheduledSeq  # noqa: E402
from splitserve.engine.model.llama import RMSNorm  # noqa: E402
from splitserve.engine.model.rotary import RotaryEmbedding  # noqa: E402
from splitserve.engine.model import triton_ops  # noqa: E402
from splitserve.engine.model.triton_ops import add_rms_norm, gated, rotate_in_place  # noqa: E402
from tests.engine.hf_checkpoints import ENGINE_ARGS, hf_logits, prompt_ids, write_checkpoint  # noqa: E402
from tests.engine.hf_checkpoints import tokenizers_by_kind  # noqa: E402, F401 (a fixture)
from tests.engine.runner_helpers import append, max_diff, new_seq, run_plan  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def norm(hidden: int, dtype: torch.dtype, gemma: bool = False) -> RMSNorm:
    module = RMSNorm(hidden, 1e-5, gemma).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.rand(hidden) + 0.5)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 48])  # a power of two and not
@pytest.mark.parametrize("gemma", [False, True])  # Gemma's norm: times (1 + weight), rounded once
def test_add_and_norm_in_one_pass(dtype, hidden, gemma):
    torch.manual_seed(0)
    module = norm(hidden, dtype, gemma)
    x, residual = torch.randn(5, hidden, dtype=dtype), torch.randn(5, hidden, dtype=dtype)
    expected_out, expected_sum = module(x, residual)
    out, summed = (t.cpu() for t in add_rms_norm(x.to(DEVICE), residual.to(DEVICE), module.weight.to(DEVICE),
                                                 module.eps, gemma))
    assert out.dtype == expected_out.dtype
    assert torch.equal(summed, expected_sum)  # the sum rounds to the activations' dtype, as the oracle's
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected_out, atol=tol, rtol=tol)


def test_norm_without_a_residual_and_of_strided_rows():
    torch.manual_seed(1)
    module = norm(32, torch.float32)
    wide = torch.randn(4, 96)
    x = wide.to(DEVICE)[:, 16:48]  # rows 96 apart, as a split of a merged projection's output
    weight = module.weight.to(DEVICE)
    out, summed = add_rms_norm(x, None, weight, module.eps)
    assert summed is x
    torch.testing.assert_close(out.cpu(), module(wide[:, 16:48]), atol=1e-5, rtol=1e-5)
    out, _ = add_rms_norm(torch.empty(0, 32, device=DEVICE), None, weight, module.eps)
    assert out.shape == (0, 32)


def test_norm_of_each_head_of_a_merged_projection():
    """Qwen3's q and k norms: one weight over head_dim, every head of a view of the fused q/k/v."""
    torch.manual_seed(3)
    module = norm(16, torch.float32)
    qkv = torch.randn(5, 8 * 16)
    heads = qkv.to(DEVICE)[:, :4 * 16].view(5, 4, 16)  # q's 4 heads; k and v follow in each row
    out, summed = add_rms_norm(heads, None, module.weight.to(DEVICE), module.eps)
    assert summed is heads and out.shape == (5, 4, 16)
    torch.testing.assert_close(out.cpu(), module(qkv[:, :4 * 16].view(5, 4, 16)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(32, 32), (24, 24), (32, 16)])  # the last: partial (Phi-4-mini)
@pytest.mark.parametrize("interleaved", [False, True])  # halves (Llama's) or neighbouring pairs (GLM's, Cohere's)
def test_rotary_in_place_on_views_of_a_merged_projection(dtype, head_dim, rotary_dim, interleaved):
    """As `RotaryEmbedding` runs it on CUDA: each head's leading `rotary_dim` dims, q's and k's in one launch."""
    torch.manual_seed(2)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=4 * head_dim,
                         intermediate_size=8, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=128, rotary_dim=rotary_dim,
                         rotary_interleaved=interleaved)
    rotary = RotaryEmbedding(config, 128)
    tokens, positions = 6, torch.tensor([0, 1, 2, 50, 127, 3])
    qkv = torch.randn(tokens, 8 * head_dim, dtype=dtype)

    def views(merged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = merged.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
        return q.view(tokens, 4, head_dim), k.view(tokens, 2, head_dim)

    expected_q, expected_k = rotary(positions, *(t.clone() for t in views(qkv)))  # the torch code, on the CPU
    q, k = views(qkv.to(DEVICE))
    rotate_in_place(positions.to(DEVICE), q[..., :rotary_dim], k[..., :rotary_dim], rotary.cos.to(DEVICE),
                    rotary.sin.to(DEVICE), interleaved=interleaved)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.cpu(), expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu(), expected_k, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gemma", [False, True])  # Qwen3's norms; Gemma 3's, times (1 + weight)
@pytest.mark.parametrize("interleaved", [False, True])  # GLM-4.5's q and k norms turn neighbouring pairs
def test_heads_normalized_then_rotated_in_one_launch(dtype, gemma, interleaved):
    """Qwen3's q and k norms and the rotation, as `RotaryEmbedding` runs them on CUDA (in place on
    the merged projection's views) against its torch code on the CPU (the norms, then the rotation)."""
    torch.manual_seed(5)
    config = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=64, rotary_interleaved=interleaved)
    rotary = RotaryEmbedding(config, 64)
    norms = norm(32, dtype, gemma), norm(32, dtype, gemma)
    positions = torch.tensor([0, 7, 63])
    qkv = torch.randn(3, 8 * 32, dtype=dtype) * 3
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    expected_q, expected_k = rotary(positions, q.reshape(3, 4, 32), k.reshape(3, 2, 32), norms)
    merged = qkv.to(DEVICE)
    q, k = merged[:, :4 * 32].view(3, 4, 32), merged[:, 4 * 32:6 * 32].view(3, 2, 32)
    weights = (norms[0].weight.to(DEVICE), norms[1].weight.to(DEVICE), norms[0].eps, gemma)
    rotate_in_place(positions.to(DEVICE), q, k, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE), weights, interleaved)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.cpu(), expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu(), expected_k, atol=tol, rtol=tol)
    torch.testing.assert_close(merged[:, 6 * 32:].cpu(), qkv[:, 6 * 32:], atol=0, rtol=0)  # v untouched
    with pytest.raises(ValueError, match="weight of 32 values"):
        rotate_in_place(positions.to(DEVICE), q, k, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                        (weights[0][:16], weights[1], 1e-6, gemma))


def test_rotary_of_q_and_k_that_are_not_one_tensor():
    """Qwen3's q and k come out of their norms as tensors of their own: each is rotated where it is."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=32)
    rotary = RotaryEmbedding(config, 32)
    positions = torch.tensor([3, 31])
    q, k = torch.randn(2, 4, 16), torch.randn(2, 1, 16)
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    q, k = q.to(DEVICE), k.to(DEVICE)
    rotate_in_place(positions.to(DEVICE), q, k, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE))
    torch.testing.assert_close(q.cpu(), expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.cpu(), expected_k, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="same tokens, dims and dtype"):
        rotate_in_place(positions.to(DEVICE), q, k[..., :8], rotary.cos.to(DEVICE), rotary.sin.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [48, 2 * triton_ops.GATED_BLOCK + 40])  # one program a row, and three
@pytest.mark.parametrize("gelu", [False, True])  # Llama's SiLU, Gemma's tanh GELU
def test_gated_activation_of_a_merged_projections_views(dtype, width, gelu):
    """act(gate) * up as `LlamaMLP` computes it with torch's ops, gate and up the halves of one output."""
    torch.manual_seed(4)
    merged = torch.randn(5, 2 * width, dtype=dtype) * 4  # past both activations' bends
    merged[0, :width] = torch.linspace(-60, 60, width)  # far out on both sides: no exp overflows
    gate, up = merged.split([width, width], dim=-1)
    expected = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    out = gated(*merged.to(DEVICE).split([width, width], dim=-1), gelu=gelu)
    assert out.dtype == dtype and out.shape == (5, width) and out.is_contiguous()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


def test_gated_activation_refuses_mismatched_halves_and_takes_no_rows():
    merged = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        gated(merged[:, :16], merged[:, 16:30])
    with pytest.raises(ValueError, match="columns contiguous"):
        gated(merged[:, 0::2], merged[:, 1::2])
    assert gated(torch.empty(0, 16, device=DEVICE), torch.empty(0, 16, device=DEVICE)).shape == (0, 16)


DENSE = {"add_rms_norm", "rotate_in_place", "gated"}
SPARSE = {"add_rms_norm", "rotate_in_place", "route"}


# Llama's norms and SiLU; Qwen3's q and k norms inside the rotation; Phi-3's half-rotated heads (the
# norms apart); Gemma 2's GELU and norms; Gemma 3's norms on q and k; OLMo 2's norms after each sublayer
# and across q's heads (strided rows of the merged projection); SmolLM3's layer without rotation (EXAONE
# 4's with per-head norms); Granite's multipliers; GLM-4.5's dense layer, shared expert and fused experts
# (its routing torch's); GLM-4's four norms and interleaved rotation; Cohere's parallel block and
# interleaved rotation (its LayerNorms torch's); Helium's and Ernie 4.5's interleaved rotation and the
# MLP's biases (Seed-OSS's too); Ernie 4.5 MoE's dense layers and shared expert (its routing torch's);
# MiniMax-M2's norms across heads and partial rotation (its routing torch's); HunYuan's per-head norms
# after the rotation; Granite 4's fused gate and up; Arcee's and Apertus's MLPs without a gate (their
# activations torch's); Qwen2-MoE's shared expert
# (an MLP) and routing (`moe_routing`), Mixtral's renormalized, GPT-OSS's
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the model on the CPU, its kernels interpreted (on CUDA: test_gpu.py's per-architecture test)")
@pytest.mark.parametrize("name, kernels", [("llama3_gqa_tied", DENSE), ("qwen3_qk_norm", DENSE),
                                           ("phi3_fused_partial", DENSE), ("gemma2", DENSE), ("gemma3", DENSE),
                                           ("olmo2", DENSE), ("smollm3", DENSE), ("granite", DENSE),
                                           ("exaone4", DENSE), ("glm4_moe", DENSE),
                                           ("glm4", DENSE), ("cohere", {"rotate_in_place", "gated"}),
                                           ("helium", DENSE), ("seed_oss", DENSE), ("ernie4_5", DENSE),
                                           ("ernie4_5_moe", DENSE), ("minimax_m2", {"add_rms_norm", "rotate_in_place"}),
                                           ("hunyuan_dense", DENSE), ("granite4_dense", DENSE),
                                           ("arcee", {"add_rms_norm", "rotate_in_place"}),
                                           ("apertus", {"add_rms_norm", "rotate_in_place"}),
                                           ("cohere_qk_norm", {"rotate_in_place", "gated"}),
                                           ("nemotron", {"rotate_in_place"}),
                                           ("qwen2_moe", DENSE | SPARSE), ("mixtral_moe", SPARSE),
                                           ("gpt_oss", SPARSE)])
def test_the_models_kernel_path_gives_transformers_logits(tmp_path, tokenizers_by_kind, monkeypatch, name, kernels):
    """The elementwise kernels a CUDA device runs, taken through the model's own code on the CPU
    (interpreted), give transformers' logits as the torch path does: a prefill, then a decode."""
    hf = write_checkpoint(tmp_path, name, tokenizers_by_kind)
    engine = LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS)
    launched = []
    monkeypatch.setattr(triton_dispatch, "runs_kernels", lambda x: True)
    for module, kernel in ((triton_dispatch.ops(), "add_rms_norm"), (triton_dispatch.ops(), "rotate_in_place"),
                           (triton_dispatch.ops(), "gated"), (moe_routing, "route")):
        monkeypatch.setattr(module, kernel, lambda *a, real=getattr(module, kernel), kernel=kernel, **k:
                            launched.append(kernel) or real(*a, **k))
    ids = prompt_ids(6, 21, hf.config.vocab_size)
    seq = new_seq(engine, "a", ids[:-1])
    prefill = run_plan(engine, [ScheduledSeq(seq, len(ids) - 1)])["a"]
    append(engine, seq, ids[-1])
    logits = torch.cat([prefill, run_plan(engine, [ScheduledSeq(seq, 1)])["a"]])
    assert set(launched) == kernels
    assert max_diff(logits, hf_logits(hf, ids)) <= 1e-4
