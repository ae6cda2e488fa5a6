"""compressed-tensors FP8 checkpoints (llm-compressor's format: `weight_scale` one a tensor, one a
row or one a block): their quantization_config read (other schemes refused naming what differs),
and a Qwen3 stored so gives the logits transformers computes from it (transformers decompresses
it with the compressed-tensors package); built as on an H100, each keeps its codes, with scales
one a block or one a row, whole on the ranks that need them.
The checkpoints compared carry no activation scheme: transformers would quantize activations as
one says (FP8_DYNAMIC's per-token scales), which the engine does not (W8A16: the same weights)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine import fp8
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.sharding import Shard
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS, hf_logits, prompt_ids, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.runner_helpers import max_diff
from tests.engine.test_fp8 import dequantized, gpu_reads_fp8, load, prefill_logits, reference  # noqa: F401 (fixture)

BLOCK = 32
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def scheme(strategy: str, activations: bool = True) -> dict:
    """An llm-compressor FP8 scheme: FP8 weights by `strategy`, with dynamic per-token FP8
    activations (FP8_DYNAMIC, FP8_BLOCK) or without (weights only)."""
    weights = {**FP8_WEIGHTS, "strategy": strategy, "block_structure": [BLOCK, BLOCK] if strategy == "block" else None}
    per_token = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": per_token if activations else None}},
            "ignore": ["lm_head"]}


def compress_checkpoint(path, strategy: str, unquantized: str = "\0", activations: bool = True) -> None:
    """Rewrite the checkpoint at `path` as llm-compressor stores one: every attention and MLP
    projection but those whose names start with `unquantized` as float8 codes and `weight_scale`."""
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.endswith("proj.weight") and not name.startswith(unquantized):
            block = {"tensor": None, "channel": (1, tensor.shape[1]), "block": (BLOCK, BLOCK)}[strategy]
            tensors[name], tensors[name + "_scale"] = fp8.quantize(tensor, block)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = scheme(strategy, activations)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_a_compressed_fp8_checkpoint_gives_transformers_logits(tmp_path, tokenizers_by_kind, strategy):
    pytest.importorskip("compressed_tensors")
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    compress_checkpoint(tmp_path, strategy, activations=False)
    scales = load_file(tmp_path / "model.safetensors")["model.layers.0.mlp.down_proj.weight_scale"]
    assert tuple(scales.shape) == {"tensor": (1,), "channel": (64, 1), "block": (2, 4)}[strategy]
    hf = reference(tmp_path)
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS), ids), hf_logits(hf, ids)
    assert ref.std().item() > 1.0 and max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_codes_are_kept_on_a_gpu_that_reads_them(tmp_path, tokenizers_by_kind, gpu_reads_fp8, strategy):
    """Built as on an H100 the projections hold the codes and their scales, one a block or one a
    row (a tensor's one scale repeated for each of its rows, a merged projection's parts' each for
    theirs), and give transformers' logits; the modules `ignore` lists (a layer's MLP, by a 're:'
    pattern) load as stored."""
    pytest.importorskip("compressed_tensors")
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    compress_checkpoint(tmp_path, strategy, unquantized="model.layers.1.mlp.", activations=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignore"] += ["re:.*layers\\.1\\.mlp\\..*"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS)
    layers = engine.runner.model.model.layers
    qkv, block = layers[0].self_attn.qkv_proj, (BLOCK, BLOCK) if strategy == "block" else fp8.ROWS
    assert qkv.fp8_block == layers[0].mlp.down_proj.fp8_block == block and layers[1].mlp.down_proj.fp8_block is None
    assert qkv.weight_scale_inv.shape == ((8, 2) if strategy == "block" else (256, 1))
    if strategy == "tensor":
        stored = load_file(tmp_path / "model.safetensors")
        for part, rows in (("q_proj", slice(0, 128)), ("k_proj", slice(128, 192)), ("v_proj", slice(192, 256))):
            scale = stored[f"model.layers.0.self_attn.{part}.weight_scale"]
            assert torch.equal(qkv.weight_scale_inv[rows], scale.expand(rows.stop - rows.start, 1))
    hf = reference(tmp_path)
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(engine, ids), hf_logits(hf, ids)
    assert max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("strategy", ["tensor", "block"])
def test_a_fused_projection_keeps_its_parts_scales(tmp_path, tokenizers_by_kind, gpu_reads_fp8, strategy):
    """Phi-3 stores Q, K and V (and gate and up) as one tensor with one `weight_scale` (a tensor's,
    or its blocks'): kept under the model's name for its parts, it gives transformers' logits."""
    pytest.importorskip("compressed_tensors")
    write_checkpoint(tmp_path, "phi3_fused_partial", tokenizers_by_kind)
    compress_checkpoint(tmp_path, strategy, activations=False)
    engine = LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_block == ((BLOCK, BLOCK) if strategy == "block" else fp8.ROWS)
    hf = reference(tmp_path)
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(engine, ids), hf_logits(hf, ids)
    assert max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_keeps_its_rows_scales_and_every_row_parallel_one(tmp_path, tokenizers_by_kind, gpu_reads_fp8, size):
    """One scale a row: a rank holds its rows' scales of the column-parallel projections (its
    heads; its slice of the MLP) and the whole of o_proj's and down's (their rows are whole on
    every rank), so its codes times its scales are exactly its part of the weights."""
    write_checkpoint(tmp_path, "qwen3_qk_norm", tokenizers_by_kind)
    compress_checkpoint(tmp_path, "channel")
    whole = load(tmp_path).model.layers[0]
    for rank in range(size):
        part = load(tmp_path, Shard(rank, size)).model.layers[0]
        heads, d = 4 // size, 128 // size
        assert part.self_attn.o_proj.fp8_block == part.mlp.gate_up_proj.fp8_block == fp8.ROWS
        assert torch.equal(part.self_attn.o_proj.weight_scale_inv, whole.self_attn.o_proj.weight_scale_inv)
        assert torch.equal(dequantized(part.self_attn.o_proj),
                           dequantized(whole.self_attn.o_proj)[:, rank * heads * 32:(rank + 1) * heads * 32])
        gate_up = dequantized(whole.mlp.gate_up_proj).view(2, size, d, 64)[:, rank].reshape(2 * d, 64)
        assert torch.equal(dequantized(part.mlp.gate_up_proj), gate_up)
        assert torch.equal(dequantized(part.mlp.down_proj), dequantized(whole.mlp.down_proj)[:, rank * d:(rank + 1) * d])


def raw(quant: dict) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "quantization_config": quant}


@pytest.mark.parametrize("strategy, block", [("tensor", None), ("channel", None), ("block", (BLOCK, BLOCK))])
def test_fp8_schemes_read_as_fp8(strategy, block):
    config = ModelConfig.from_hf(raw(scheme(strategy)))
    assert (config.quantization, config.weight_block_size) == ("fp8", block)
    assert config.stored_unquantized("lm_head") and not config.stored_unquantized("model.layers.0.mlp.down_proj")


def group(**weights) -> dict:
    quant = scheme("channel")
    quant["config_groups"]["group_0"]["weights"].update(weights)
    return quant


@pytest.mark.parametrize("quant, message", [
    ({**scheme("channel"), "format": "nvfp4-pack-quantized"}, r"format 'nvfp4-pack-quantized' is not supported"),
    ({**scheme("channel", activations=False), "format": "pack-quantized"},
     r"8-bit float weights are not supported in pack-quantized"),  # packs hold integers (test_int_weights)
    (group(num_bits=4, type="int"), r"weights.num_bits 4 is not supported"),
    (group(symmetric=False), r"weights.symmetric False is not supported"),
    (group(strategy="group", group_size=128), r"weights.strategy 'group' is not supported \(supported: tensor, "),
    (group(strategy="block", block_structure=[128]), r"weights.block_structure must be \[rows, cols\]"),
    ({**scheme("channel"), "quantization_status": "frozen"}, r"quantization_status 'frozen' is not supported"),
    ({**scheme("channel"), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config .* is not supported"),
    ({**scheme("channel"), "config_groups": {"group_0": {**scheme("channel")["config_groups"]["group_0"],
                                                         "targets": ["re:.*self_attn.*"]}}}, r"targets must be"),
    ({**scheme("channel"), "config_groups": {"a": scheme("channel")["config_groups"]["group_0"],
                                             "b": scheme("block")["config_groups"]["group_0"]}},
     "config_groups quantize weights differently"),
    ({**scheme("channel"), "ignore": "lm_head"}, "ignore must be a list")])
def test_other_compressed_schemes_are_refused_naming_the_field(quant, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw(quant))
