"""MXFP4 checkpoints (GPT-OSS's release format): dequantized as transformers dequantizes them, and a
checkpoint whose experts are stored so loads, whole or a tensor-parallel rank's part."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from splitserve.engine.config import ConfigError
from splitserve.engine.loader import CheckpointError, load_model_config, load_weights
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.sharding import Shard
from splitserve.engine.mxfp4 import dequantize
from tests.engine.test_moe_checkpoints import make_gpt_oss

WIDTH = 64  # the experts' width: two 32-value groups of down_proj's inputs


def packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., groups, 16] and scales [..., groups] (powers of two near one)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g),
            torch.randint(122, 131, shape, dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_as_transformers_dequantizes(dtype):
    blocks, scales = packed((3, 10, 2), seed=0)
    scales[0, 0] = torch.tensor([0, 254], dtype=torch.uint8)  # the extreme powers (255 is E8M0's NaN)
    ours = dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 10, 64)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_any_leading_dims_keep_their_shape():
    blocks, scales = packed((2, 3, 4, 2), seed=1)
    whole = dequantize(blocks, scales, torch.float32)
    assert whole.shape == (2, 3, 4, 64)
    assert torch.equal(dequantize(blocks[1, 2], scales[1, 2], torch.float32), whole[1, 2])  # one expert's rows


def test_malformed_blocks_are_refused():
    blocks, scales = packed((2, 4, 1), seed=0)
    with pytest.raises(ValueError, match=r"scales uint8 \[..., rows, groups\]"):
        dequantize(blocks, scales[..., :0], torch.float32)


def write_mxfp4_checkpoint(path, drop=None):
    """A GPT-OSS checkpoint as OpenAI's release stores one: every layer's experts in MXFP4; and
    the experts' weights transformers dequantizes from it, per tensor name."""
    model = make_gpt_oss(intermediate_size=WIDTH)
    model.save_pretrained(path)
    tensors, expected = dict(model.state_dict()), {}
    experts = model.config.num_local_experts
    hidden = model.config.hidden_size
    for layer in range(model.config.num_hidden_layers):
        owner = f"model.layers.{layer}.mlp.experts"
        for i, (name, out_features, in_features) in enumerate((("gate_up_proj", 2 * WIDTH, hidden),
                                                               ("down_proj", hidden, WIDTH))):
            blocks, scales = packed((experts, out_features, in_features // 32), seed=10 * layer + i)
            del tensors[f"{owner}.{name}"]
            tensors[f"{owner}.{name}_blocks"], tensors[f"{owner}.{name}_scales"] = blocks, scales
            expected[f"{owner}.{name}"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    if drop is not None:
        del tensors[drop]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("shard", [Shard(), Shard(1, 2)], ids=["whole", "rank-1-of-2"])
def test_an_mxfp4_checkpoint_loads_its_experts_dequantized(tmp_path, shard):
    expected = write_mxfp4_checkpoint(tmp_path)
    ours = LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64, shard=shard,
                            reduce=(lambda t: t) if shard.size > 1 else None)
    load_weights(ours, tmp_path)
    lo, hi = shard.split(WIDTH)
    for layer, block in enumerate(ours.model.layers):
        experts = block.mlp.experts
        gate_up = expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [experts, in, out]: gate, up alternate
        down = expected[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert torch.equal(experts.w13, gate_up[:, :, 2 * lo:2 * hi].transpose(1, 2))
        assert torch.equal(experts.w2, down[:, lo:hi].transpose(1, 2))


def test_a_half_missing_is_named(tmp_path):
    write_mxfp4_checkpoint(tmp_path, drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.down_proj'\] lack their _blocks or _scales"):
        load_weights(LlamaForCausalLM(load_model_config(tmp_path), max_model_len=64), tmp_path)


@pytest.mark.parametrize("quant", [{"quant_method": "awq", "bits": 4}, "mxfp4"])
def test_other_quantizations_are_refused_naming_the_method(tmp_path, quant):
    make_gpt_oss().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method .* is not supported for GptOssForCausalLM .*mxfp4"):
        load_model_config(tmp_path)
