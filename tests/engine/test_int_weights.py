"""compressed-tensors' packed integer checkpoints (llm-compressor's W4A16 and W8A16): packed by the
compressed-tensors package itself, they give the logits transformers computes from the weights that
package decompresses (and, symmetric, from the packed checkpoint itself, which transformers loads
through it; with zero points its loader allocates them unpacked and refuses the file), symmetric
or with zero points, a scale a group or a row, dense and MoE, whole and over tensor-parallel ranks;
their quantization_config read, other integer schemes refused naming the field; a part missing is
named."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine import fp8
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.int_weights import IntWeights
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import CheckpointError, load_model_config
from splitserve.engine.model.sharding import Shard
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS, hf_logits, prompt_ids, rewrite_quantized, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.runner_helpers import max_diff
from tests.engine.test_fp8 import load, prefill_logits, reference

GROUP = 16


def weights_scheme(bits: int, symmetric: bool, group: int | None) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
            "group_size": group, "dynamic": False, "actorder": None}


def quant_config(weights: dict, activations: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"]}


def qparams(weight: torch.Tensor, bits: int, symmetric: bool, group: int | None):
    """Scales and zero points from each group's range, as a min-max observer sets them."""
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, -1, group or cols)
    top = 2 ** (bits - 1) - 1
    if symmetric:
        return grouped.abs().amax(-1).clamp_min(1e-8) / top, None
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = ((high - low) / (2 ** bits - 1)).clamp_min(1e-8)
    return scale, (-top - 1 - torch.round(low / scale)).clamp(-top - 1, top).to(torch.int8)


def pack_checkpoint(path, bits: int, symmetric: bool, group: int | None, dense=None) -> None:
    """Rewrite the checkpoint at `path` as llm-compressor stores one, packed by compressed-tensors:
    every attention, MLP and expert projection as `weight_packed`, `weight_scale`, `weight_shape`
    (and `weight_zero_point`). `dense`: a directory to write the same checkpoint to unquantized,
    each weight as compressed-tensors decompresses it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights_scheme(bits, symmetric, group)))
    tensors, decompressed = {}, {}
    for name, tensor in load_file(path / "model.safetensors").items():
        decompressed[name] = tensor.contiguous()
        if name.endswith("proj.weight") and tensor.dim() == 2:
            scale, zero_point = qparams(tensor, bits, symmetric, group)
            state = {"weight": tensor, "weight_scale": scale.to(tensor.dtype)}
            if zero_point is not None:
                state["weight_zero_point"] = zero_point
            packed = PackedQuantizationCompressor.compress(state, scheme)
            for part, value in packed.items():
                tensors[name.removesuffix("weight") + part] = value.contiguous()
            decompressed[name] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"].to(tensor.dtype)
        else:
            tensors[name] = tensor.contiguous()
    rewrite_quantized(path, tensors, quant_config(weights_scheme(bits, symmetric, group)), dense, decompressed)


@pytest.mark.parametrize("name, bits, symmetric, group", [
    ("qwen3_qk_norm", 4, True, GROUP), ("qwen3_qk_norm", 4, False, GROUP), ("qwen3_qk_norm", 8, True, None),
    ("llama3_gqa_tied", 4, False, None), ("phi3_fused_partial", 8, False, GROUP), ("qwen3_moe", 4, True, GROUP)])
def test_a_packed_checkpoint_gives_transformers_logits(tmp_path, tokenizers_by_kind, name, bits, symmetric, group):
    pytest.importorskip("compressed_tensors")
    packed = tmp_path / "packed"
    packed.mkdir()
    write_checkpoint(packed, name, tokenizers_by_kind)
    pack_checkpoint(packed, bits, symmetric, group, dense=tmp_path / "dense")
    assert load_model_config(packed).int_weights == IntWeights(bits, group, symmetric)
    hf = reference(tmp_path / "dense")
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(LLMEngine(str(packed), dtype="float32", **ENGINE_ARGS), ids), hf_logits(hf, ids)
    assert ref.std().item() > 1.0 and max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)
    if symmetric:
        assert max_diff(hf_logits(reference(packed), ids), ref) <= 1e-4


@pytest.fixture
def gpu_build(monkeypatch):
    """Models built as on a CUDA device (on this machine's CPU): dense projections keep the words."""
    monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))


@pytest.mark.parametrize("name, bits, symmetric, group", [
    ("qwen3_qk_norm", 4, False, GROUP), ("phi3_fused_partial", 4, True, None), ("llama3_gqa_tied", 8, False, GROUP)])
def test_on_a_gpu_dense_projections_keep_the_packed_words(tmp_path, tokenizers_by_kind, gpu_build, name, bits,
                                                           symmetric, group):
    """Built as on a GPU, the attention and MLP projections hold the checkpoint's words, scales and
    zero points (a merged projection's parts' rows stacked; Phi-3 stores Q, K and V as one tensor),
    no weight in the serving dtype, and give transformers' logits (the CPU path dequantizing them as
    it multiplies)."""
    pytest.importorskip("compressed_tensors")
    packed = tmp_path / "packed"
    packed.mkdir()
    write_checkpoint(packed, name, tokenizers_by_kind)
    pack_checkpoint(packed, bits, symmetric, group, dense=tmp_path / "dense")
    engine = LLMEngine(str(packed), dtype="float32", **ENGINE_ARGS)
    layer = engine.runner.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert linear.ints == IntWeights(bits, group, symmetric) and linear.weight is None
        assert linear.weight_packed.dtype == torch.int32
        assert linear.weight_packed.shape[1] == -(-linear.in_features * bits // 32)
        assert (linear.weight_zero_point is None) == symmetric
    hf = reference(tmp_path / "dense")
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    assert max_diff(prefill_logits(engine, ids), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("size, kept", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_ranks_add_up_to_the_whole_model(tmp_path, tokenizers_by_kind, monkeypatch, size, kept):
    """Each rank keeps its slice of every projection, dequantized or (built as on a GPU) packed: a
    merged one's parts' rows (and their zero points' words), a row-parallel one's columns in whole
    words and groups: the ranks' partial sums are the whole layer's."""
    pytest.importorskip("compressed_tensors")
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    pack_checkpoint(tmp_path, 4, False, GROUP)
    if kept:
        monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    whole = load(tmp_path).model.layers[0]
    assert (whole.mlp.down_proj.ints is not None) == kept
    x = torch.randn(3, whole.mlp.down_proj.out_features)  # the hidden size
    ranks = [load(tmp_path, Shard(rank, size)).model.layers[0] for rank in range(size)]
    mlp = sum(rank.mlp(x) for rank in ranks)
    assert max_diff(mlp, whole.mlp(x)) <= 1e-4


@pytest.mark.parametrize("weights, field", [
    ({**weights_scheme(3, True, GROUP)}, "3-bit int"),
    ({**weights_scheme(4, True, GROUP), "type": "float"}, "4-bit float"),
    ({**weights_scheme(4, True, GROUP), "strategy": "tensor"}, "strategy 'tensor'"),
    ({**weights_scheme(4, True, GROUP), "actorder": "group"}, "actorder 'group'"),
    ({**weights_scheme(4, True, None), "strategy": "group"}, "group_size"),
    ({**weights_scheme(4, "yes", GROUP)}, "symmetric"),
])
def test_other_integer_schemes_are_refused_naming_the_field(weights, field):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 300,
              "quantization_config": quant_config(weights)}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(config, source="config.json")
    activations = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    with pytest.raises(ConfigError, match="W8A8"):
        ModelConfig.from_hf({**config, "quantization_config": quant_config(weights_scheme(8, True, None), activations)},
                            source="config.json")


def test_a_weight_missing_a_part_is_named(tmp_path, tokenizers_by_kind):
    pytest.importorskip("compressed_tensors")
    write_checkpoint(tmp_path, "llama3_gqa_tied", tokenizers_by_kind)
    pack_checkpoint(tmp_path, 4, False, GROUP)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_zero_point"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight_zero_point"):
        load(tmp_path)


def test_dummy_packed_projections_are_random_words(tmp_path, tokenizers_by_kind, gpu_build):
    """Dummy weights (`load_format: dummy`, the GPU benchmark's) for projections kept packed:
    uniformly random words and zero points at the dummy scale, weights spread about 0 like the
    dense dummies (4 bits: (value - zero point) / 256, a std of about 0.025)."""
    pytest.importorskip("compressed_tensors")
    from splitserve.engine.dummy_weights import init_dummy_weights
    from splitserve.engine.model.llama import LlamaForCausalLM

    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    pack_checkpoint(tmp_path, 4, False, GROUP)
    model = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64)
    init_dummy_weights(model, seed=3)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.ints is not None and torch.all(qkv.weight_scale == fp8.DUMMY_SCALE)
    values = qkv.dequantized(torch.float32)
    assert abs(values.mean().item()) < 0.002 and 0.02 < values.std().item() < 0.03
