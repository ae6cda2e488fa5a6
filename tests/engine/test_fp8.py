"""FP8 checkpoints (block-wise, as Qwen3's FP8 releases store them): dequantized as transformers
dequantizes them (its FineGrainedFP8 path, which dequantizes on a machine without a GPU), and a
dense and an MoE checkpoint whose linear weights are stored so give transformers' logits (over
tensor-parallel ranks: test_tensor_parallel.py); an MoE's experts stay FP8 (the kernels that read
the codes: test_fused_moe.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine import fp8
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.fp8 import DUMMY_SCALE, dequantize, quantize
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.dummy_weights import init_dummy_weights
from splitserve.engine.loader import CheckpointError, load_model_config, load_weights
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.moe import route
from splitserve.engine.model.sharding import Shard, kv_head_range
from splitserve.engine.policies import ScheduledSeq
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS, hf_logits, prompt_ids, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.runner_helpers import max_diff, new_seq, run_plan

BLOCK = 32


def transformers_dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=torch.float32)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["blocks", "tensor"])
def test_dequantized_as_transformers_dequantizes(block):
    block = None if block is None else (block, block)
    codes, scale = quantize(torch.randn(96, 64, generator=torch.Generator().manual_seed(0)), block)
    assert torch.equal(dequantize(codes, scale, block, torch.float32),
                       transformers_dequantized(codes, scale))


def test_partial_blocks_take_their_own_scale():
    """70 x 50 in 32 x 32 blocks: the last row and column of blocks are partial (ceil, as vLLM
    reads them); each value is its code times its block's scale."""
    codes, scale = quantize(torch.randn(70, 50, generator=torch.Generator().manual_seed(1)), (BLOCK, BLOCK))
    ours = dequantize(codes, scale, (BLOCK, BLOCK), torch.float32)
    for r, c in [(0, 0), (31, 32), (64, 49), (69, 0), (69, 49)]:
        assert ours[r, c] == codes[r, c].float() * scale[r // BLOCK, c // BLOCK]


def test_malformed_scales_are_refused():
    codes, scale = quantize(torch.randn(70, 50), (BLOCK, BLOCK))
    with pytest.raises(ValueError, match=r"in 32x32 blocks must be 3x2, got \(2, 2\)"):
        dequantize(codes, scale[:2], (BLOCK, BLOCK), torch.float32)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        dequantize(codes.float(), scale, (BLOCK, BLOCK), torch.float32)


def quantize_checkpoint(path, block: int | None = BLOCK, drop: str | None = None, static: bool = False) -> None:
    """Rewrite the checkpoint at `path` as an FP8 release stores one: every attention and MLP
    projection (each expert's too) as float8 codes and `weight_scale_inv` (`static`: AutoFP8's
    `weight_scale` and an `input_scale`), the embeddings, norms, routers and LM head as they were;
    without tensor `drop`."""
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):  # Mixtral-named experts too
            scales = name + ("_scale" if static else "_scale_inv")
            tensors[name], tensors[scales] = quantize(tensor, None if block is None else (block, block))
            if static:
                tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        else:
            tensors[name] = tensor.contiguous()
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                                     "fmt": "e4m3",
                                     "weight_block_size": None if block is None else [block, block]}
    (path / "config.json").write_text(json.dumps(config))


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    seq = new_seq(engine, "a", ids)
    return run_plan(engine, [ScheduledSeq(seq, len(ids))])["a"]


@pytest.mark.parametrize("name, block", [("qwen3_qk_norm", BLOCK), ("qwen3_qk_norm", None), ("qwen3_moe", BLOCK),
                                         ("qwen3_moe", None), ("minimax_m2", BLOCK)])  # MiniMax-M2's release is FP8
def test_an_fp8_checkpoint_gives_transformers_logits(tmp_path, tokenizers_by_kind, name, block):
    write_checkpoint(tmp_path, name, tokenizers_by_kind)
    quantize_checkpoint(tmp_path, block)
    config = load_model_config(tmp_path)
    assert config.quantization == "fp8" and config.weight_block_size == (None if block is None else (block, block))
    hf = reference(tmp_path)
    assert "Fp8" not in type(hf.model.layers[0].self_attn.q_proj).__name__  # dequantized: the reference math
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS), ids), hf_logits(hf, ids)
    assert ref.std().item() > 1.0 and max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("capability", [None, (9, 0)], ids=["dequantized", "kept"])
def test_autofp8_s_static_checkpoints_load_alike(tmp_path, tokenizers_by_kind, monkeypatch, capability):
    """Tensor-wise scales named `weight_scale`, beside `input_scale`s (unused: activations stay in
    the serving dtype), give the logits of the same codes with their scales named as above, both
    dequantized at load and, as on an H100, kept (each part's scale repeated for its rows)."""
    monkeypatch.setattr(fp8, "build_capability", lambda: capability)
    logits = []
    for static in (False, True):
        path = tmp_path / str(static)
        hf = write_checkpoint(path, "qwen3_qk_norm", tokenizers_by_kind)
        quantize_checkpoint(path, None, static=static)
        ids = prompt_ids(1, 37, hf.config.vocab_size)
        engine = LLMEngine(str(path), dtype="float32", **ENGINE_ARGS)
        assert engine.runner.model.model.layers[0].self_attn.qkv_proj.fp8_block == (capability and fp8.ROWS)
        logits.append(prefill_logits(engine, ids))
    assert torch.equal(*logits)


def test_a_weight_without_its_scales_is_named(tmp_path, tokenizers_by_kind):
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    quantize_checkpoint(tmp_path, drop="model.layers.1.mlp.down_proj.weight_scale_inv")
    with pytest.raises(CheckpointError,
                       match=r"lack their other half: \['model.layers.1.mlp.down_proj.weight_scale_inv \(or _scale\)'\]"):
        LLMEngine(str(tmp_path), **ENGINE_ARGS)


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be \[rows, cols\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size\[1\] must be a positive integer"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "gptq"}, r"quant_method 'gptq' is not supported for Qwen3ForCausalLM \(supported: fp8, "
                               r"compressed-tensors, awq\)"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["layers.(0"]}, r"'layers.\(0' is not a regular expression")])
def test_fp8_configs_are_checked(quant, message):
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "quantization_config": quant}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


@pytest.fixture
def gpu_reads_fp8(monkeypatch):
    """Models built as on an H100, whose Triton reads float8 e4m3 (on this machine's CPU)."""
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))


@pytest.mark.parametrize("name", ["qwen3_qk_norm", "phi3_fused_partial"])
def test_dense_projections_keep_their_codes_where_triton_reads_them(tmp_path, tokenizers_by_kind, gpu_reads_fp8,
                                                                     name):
    """On a GPU whose Triton reads e4m3 the attention and MLP projections hold the checkpoint's
    codes (a byte a weight) and block scales, a merged projection's parts' scale rows stacked like
    their rows (Phi-3 stores Q, K and V as one tensor), and give transformers' logits."""
    write_checkpoint(tmp_path, name, tokenizers_by_kind)
    quantize_checkpoint(tmp_path)
    engine = LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS)
    layer = engine.runner.model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.weight.dtype == down.weight.dtype == torch.float8_e4m3fn and qkv.fp8_block == (BLOCK, BLOCK)
    assert qkv.weight_scale_inv.shape == (qkv.out_features // BLOCK, 64 // BLOCK)
    hf = reference(tmp_path)
    codes, scales = quantize(hf.model.layers[0].mlp.down_proj.weight.detach(), (BLOCK, BLOCK))
    assert torch.equal(down.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(down.weight_scale_inv,
                                                                                               scales)
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(engine, ids), hf_logits(hf, ids)
    assert ref.std().item() > 1.0 and max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("capability", [(8, 0), None])
def test_dense_projections_are_dequantized_where_triton_cannot_read_them(tmp_path, tokenizers_by_kind, monkeypatch,
                                                                          capability):
    """An A100 (Triton refuses e4m3 before sm_89) and the CPU path multiply in the serving dtype."""
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    quantize_checkpoint(tmp_path)
    monkeypatch.setattr(fp8, "build_capability", lambda: capability)
    attention = load(tmp_path).model.layers[0].self_attn
    assert attention.qkv_proj.fp8_block is None and attention.o_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_keeps_whole_blocks_of_the_codes(tmp_path, tokenizers_by_kind, gpu_reads_fp8, size):
    """Every part's slice is whole 32-row blocks (a rank's query heads, 32 rows each; its KV heads,
    over 4 ranks the one of its 2 it reads, replicated; its 128 / size of the MLP's width), and
    each rank holds exactly its rows (columns, for o_proj and down) of the codes and of the scales."""
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    quantize_checkpoint(tmp_path)
    whole = load(tmp_path).model.layers[1]
    qkv = dequantized(whole.self_attn.qkv_proj)
    q, k, v = qkv[:128].view(4, 32, 64), qkv[128:192].view(2, 32, 64), qkv[192:].view(2, 32, 64)
    for rank in range(size):
        part = load(tmp_path, Shard(rank, size)).model.layers[1]
        attention, mlp, heads, d = part.self_attn, part.mlp, 4 // size, 128 // size
        assert attention.qkv_proj.fp8_block == mlp.down_proj.fp8_block == (BLOCK, BLOCK)
        lo, hi = kv_head_range(2, rank, size)
        expected = torch.cat([q[rank * heads:(rank + 1) * heads].flatten(0, 1), k[lo:hi].flatten(0, 1),
                              v[lo:hi].flatten(0, 1)])
        assert torch.equal(dequantized(attention.qkv_proj), expected)
        assert torch.equal(dequantized(attention.o_proj),
                           dequantized(whole.self_attn.o_proj)[:, rank * heads * 32:(rank + 1) * heads * 32])
        gate_up = dequantized(whole.mlp.gate_up_proj).view(2, size, d, 64)[:, rank].reshape(2 * d, 64)
        assert torch.equal(dequantized(mlp.gate_up_proj), gate_up)
        assert torch.equal(dequantized(mlp.down_proj), dequantized(whole.mlp.down_proj)[:, rank * d:(rank + 1) * d])


def test_a_cut_inside_a_block_dequantizes_that_projection(tmp_path, tokenizers_by_kind, gpu_reads_fp8):
    """In 64-row blocks, 2 ranks' 32 rows of K would cut a block: their attention is dequantized
    at load, while the MLP's 64 rows a rank stay FP8."""
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    quantize_checkpoint(tmp_path, block=64)
    layer = load(tmp_path, Shard(1, 2)).model.layers[0]
    assert layer.self_attn.qkv_proj.fp8_block is None and layer.self_attn.qkv_proj.weight.dtype == torch.float32
    assert layer.mlp.gate_up_proj.fp8_block == layer.mlp.down_proj.fp8_block == (64, 64)


def dequantized(linear) -> torch.Tensor:
    if linear.fp8_block is None:
        return linear.weight.detach()
    return dequantize(linear.weight, linear.weight_scale_inv, linear.fp8_block, torch.float32)


def test_modules_stored_unquantized_stay_in_their_dtype(tmp_path, tokenizers_by_kind, gpu_reads_fp8):
    """A checkpoint whose quantization_config lists modules it did not quantize (transformers'
    modules_to_not_convert: here layer 0's MLP) loads them as stored, the rest FP8; one that
    stores a projection unquantized without saying so is refused, naming the tensor."""
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    original = load_file(tmp_path / "model.safetensors")
    quantize_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.{proj}.weight"
        tensors[name] = original[name]
        del tensors[name + "_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' is stored as F32, not float8"):
        load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.mlp"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load(tmp_path)
    assert model.model.layers[0].mlp.down_proj.fp8_block is None and model.model.layers[1].mlp.down_proj.fp8_block
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, original["model.layers.0.mlp.down_proj.weight"])
    hf = reference(tmp_path)
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS), ids), hf_logits(hf, ids)
    assert max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


def write_qwen3_moe(path, width: int = 96, block: int | None = BLOCK) -> None:
    """A tiny Qwen3-MoE, its experts `width` wide (three 32-row blocks), in FP8 blocks of 32 (None:
    one scale a tensor)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=width,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    quantize_checkpoint(path, block)


def load(path, shard=Shard()) -> LlamaForCausalLM:
    model = LlamaForCausalLM(load_model_config(path), max_model_len=64, shard=shard,
                             reduce=(lambda t: t) if shard.size > 1 else None)
    load_weights(model, path)
    return model


@pytest.mark.parametrize("size, widths", [(2, [64, 32]), (3, [32, 32, 32]), (4, [24, 24, 24, 24])])
def test_experts_stay_fp8_in_whole_blocks_and_ranks_add_up(tmp_path, size, widths):
    """The experts keep their codes and block scales (a byte a weight) where each rank's slice of
    the width is whole blocks (96 in 32s: 64 and 32 over 2 ranks); over 4 ranks they are
    dequantized. Either way the ranks' partial sums add up to the whole layer's experts."""
    write_qwen3_moe(tmp_path)
    whole = load(tmp_path).model.layers[0].mlp
    assert whole.experts.format == "fp8" and whole.experts.w13.dtype == torch.float8_e4m3fn
    assert whole.experts.w13_scale.shape == (4, 2 * 96 // 32, 64 // 32)
    ranks = [load(tmp_path, Shard(r, size)).model.layers[0].mlp.experts for r in range(size)]
    assert [r.width for r in ranks] == widths and {r.format for r in ranks} == {"fp8" if size < 4 else None}
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = route(whole.gate(x), 2, renormalize=True)
    expected = whole.experts(x, weights, ids)
    torch.testing.assert_close(sum(r(x, weights, ids) for r in ranks), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("size", [1, 3, 4])
def test_experts_keep_one_scale_a_row_on_any_split(tmp_path, size):
    """Tensor-wise scales are kept one a row (each expert's projection's one scale repeated): a
    rank's slice of the width is any (96 over 4: 24 each), its gate and up rows' scales its own and
    down's whole; the ranks' partial sums add up to the whole layer's experts."""
    write_qwen3_moe(tmp_path, block=None)
    whole = load(tmp_path).model.layers[0].mlp
    assert whole.experts.format == "fp8" and whole.experts.block == fp8.ROWS
    assert whole.experts.w13_scale.shape == (4, 2 * 96, 1) and whole.experts.w2_scale.shape == (4, 64, 1)
    ranks = [load(tmp_path, Shard(r, size)).model.layers[0].mlp.experts for r in range(size)]
    assert {r.format for r in ranks} == {"fp8"} and sum(r.width for r in ranks) == 96
    assert all(torch.equal(r.w2_scale, whole.experts.w2_scale) for r in ranks)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = route(whole.gate(x), 2, renormalize=True)
    expected = whole.experts(x, weights, ids)
    torch.testing.assert_close(sum(r(x, weights, ids) for r in ranks), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


def test_dummy_fp8_experts_are_codes_of_the_dummy_spread(tmp_path):
    write_qwen3_moe(tmp_path)
    model = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64)
    init_dummy_weights(model, seed=3)
    experts = model.model.layers[0].mlp.experts
    assert torch.all(experts.w13_scale == DUMMY_SCALE)
    values = torch.stack([experts.stacks(torch.float32)[0][e] for e in range(4)])
    assert 0.018 < values.std().item() < 0.022


@pytest.mark.parametrize("block", [BLOCK, None])
def test_dummy_fp8_projections_are_codes_of_the_dummy_spread(tmp_path, gpu_reads_fp8, block):
    """Dummy weights (`load_format: dummy`, the GPU benchmark's) for projections kept FP8: codes of
    normal(0, 0.02) at the dummy scale, one a block or one a row."""
    write_qwen3_moe(tmp_path, block=block)
    model = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64)
    init_dummy_weights(model, seed=3)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_block == ((BLOCK, BLOCK) if block else fp8.ROWS) and torch.all(qkv.weight_scale_inv == DUMMY_SCALE)
    values = dequantize(qkv.weight, qkv.weight_scale_inv, qkv.fp8_block, torch.float32)
    assert 0.018 < values.std().item() < 0.022


@pytest.mark.parametrize("capability, kept", [((8, 0), None), ((8, 9), "fp8"), ((9, 0), "fp8")])
def test_experts_stay_fp8_only_where_triton_reads_the_codes(tmp_path, monkeypatch, capability, kept):
    """Triton converts float8 e4m3 on sm_89 and later (Ada, Hopper): built for an A100, the experts
    are dequantized at load instead."""
    write_qwen3_moe(tmp_path)
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    experts = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64).model.layers[0].mlp.experts
    assert experts.format == kept
