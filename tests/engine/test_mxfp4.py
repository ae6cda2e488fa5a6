"""MXFP4 checkpoints (GPT-OSS's release format): dequantized as transformers dequantizes them, and a
checkpoint whose experts are stored so loads, whole or a tensor-parallel rank's part, kept packed
(the kernels that read the bytes: test_fused_moe.py) or dequantized at load."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from splitserve.engine.config import ConfigError
from splitserve.engine.dummy_weights import init_dummy_weights
from splitserve.engine.loader import CheckpointError, load_model_config, load_weights
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.moe import route
from splitserve.engine.model.sharding import Shard
from splitserve.engine.mxfp4 import DUMMY_SCALE, SUFFIXES, dequantize
from tests.engine.test_moe_checkpoints import make_gpt_oss

WIDTH = 96  # the experts' width: three 32-value groups of down_proj's inputs


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


def quantize_experts(path, width: int = WIDTH, drop: str | None = None, scale_shift: int = 0) -> dict:
    """Rewrite the GPT-OSS checkpoint at `path` as OpenAI's release stores one: every layer's
    experts, `width` wide, as random MXFP4 (scales shifted by `scale_shift` powers of two, gate and
    up biases drawn anew) and `quantization_config` saying so; without tensor `drop`. Returns the
    experts' weights transformers dequantizes from it, per tensor name ([experts, in, out])."""
    config = json.loads((path / "config.json").read_text())
    tensors = {k: v.contiguous() for k, v in load_file(path / "model.safetensors").items()}
    experts, hidden, expected = config["num_local_experts"], config["hidden_size"], {}
    for layer in range(config["num_hidden_layers"]):
        owner = f"model.layers.{layer}.mlp.experts"
        for i, (name, out_features, in_features) in enumerate((("gate_up_proj", 2 * width, hidden),
                                                               ("down_proj", hidden, width))):
            blocks, scales = packed((experts, out_features, in_features // 32), seed=10 * layer + i)
            scales += scale_shift
            del tensors[f"{owner}.{name}"]
            tensors[f"{owner}.{name}_blocks"], tensors[f"{owner}.{name}_scales"] = blocks, scales
            expected[f"{owner}.{name}"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        bias = torch.randn(experts, 2 * width, generator=torch.Generator().manual_seed(layer))
        tensors[f"{owner}.gate_up_proj_bias"] = bias
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(path / "model.safetensors"))
    config["intermediate_size"] = width
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    return expected


def write_mxfp4_checkpoint(path, drop=None) -> dict:
    make_gpt_oss(intermediate_size=WIDTH).save_pretrained(path)
    return quantize_experts(path, drop=drop)


def load(path, shard=Shard()) -> LlamaForCausalLM:
    model = LlamaForCausalLM(load_model_config(path), max_model_len=64, shard=shard,
                             reduce=(lambda t: t) if shard.size > 1 else None)
    load_weights(model, path)
    return model


@pytest.mark.parametrize("shard, lo, hi, packed", [
    (Shard(), 0, 96, True), (Shard(0, 2), 0, 64, True), (Shard(1, 2), 64, 96, True),  # whole groups: 2 and 1
    (Shard(1, 4), 24, 48, False)], ids=["whole", "rank-0-of-2", "rank-1-of-2", "rank-1-of-4"])  # 3 groups, 4 ranks
def test_an_mxfp4_checkpoint_loads_its_experts(tmp_path, shard, lo, hi, packed):
    """Kept packed, a rank's slice of the width in whole 32-value groups (the first rank a group
    more where they do not divide evenly); dequantized at load, an equal slice each, where there are
    fewer groups than ranks. Either way they are the weights transformers dequantizes, the rank's
    part of them."""
    expected = write_mxfp4_checkpoint(tmp_path)
    for layer, block in enumerate(load(tmp_path, shard).model.layers):
        experts = block.mlp.experts
        assert (experts.format == "mxfp4") == packed and experts.width == hi - lo
        w13, w2 = experts.stacks(torch.float32)
        gate_up = expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [experts, in, out]: gate, up alternate
        down = expected[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(gate_up.shape[0]):
            assert torch.equal(w13[e], gate_up[e, :, 2 * lo:2 * hi].T)
            assert torch.equal(w2[e], down[e, lo:hi].T)


def test_packed_experts_compute_what_their_dequantized_weights_do(tmp_path):
    """Each sparse layer on its packed experts (each expert dequantized as it runs: the CPU path)
    equals the same layer loaded from the checkpoint with those experts saved dequantized, bit for bit."""
    expected = write_mxfp4_checkpoint(tmp_path / "packed")
    (tmp_path / "dense").mkdir()
    tensors = load_file(tmp_path / "packed" / "model.safetensors")
    save_file({**{k: v for k, v in tensors.items() if not k.endswith(SUFFIXES)}, **expected},
              str(tmp_path / "dense" / "model.safetensors"))
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    packed_model, dense_model = load(tmp_path / "packed"), load(tmp_path / "dense")
    x = torch.randn(12, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(packed_model.model.layers, dense_model.model.layers):
        assert ours.mlp.experts.format == "mxfp4" and theirs.mlp.experts.format is None
        assert torch.equal(ours.mlp(x), theirs.mlp(x))


def test_dummy_packed_experts_are_random_codes_near_the_dummy_scale(tmp_path):
    """load_format=dummy draws MXFP4 codes (uniform bytes) with one scale, so the experts' values
    have about the other weights' spread; a rank holds the whole model's part."""
    write_mxfp4_checkpoint(tmp_path)
    config = load_model_config(tmp_path)
    whole, rank = (LlamaForCausalLM(config, max_model_len=64, shard=shard, reduce=lambda t: t)
                   for shard in (Shard(), Shard(1, 2)))
    for model in (whole, rank):
        init_dummy_weights(model, seed=5)
    experts, part = whole.model.layers[1].mlp.experts, rank.model.layers[1].mlp.experts
    assert torch.all(experts.w13_scales == DUMMY_SCALE)
    values = torch.stack([experts.stacks(torch.float32)[0][e] for e in range(4)])
    assert 0.015 < values.pow(2).mean().sqrt() < 0.03 and values.unique().numel() == 15  # every code (±0 alike)
    assert torch.equal(part.w13_blocks, experts.w13_blocks[:, 128:])  # rows of gate, up pairs 64..95
    assert torch.equal(part.w2_blocks, experts.w2_blocks[:, :, 2:])  # the third group of the width


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_of_unequal_widths_add_up_to_the_whole_layer(tmp_path, size):
    """Over 2 ranks the three groups split 2 + 1: each rank's experts give a partial sum (what the
    all-reduce adds), and the partial sums add up to the whole layer's experts."""
    write_mxfp4_checkpoint(tmp_path)
    whole = load(tmp_path).model.layers[0].mlp
    ranks = [load(tmp_path, Shard(r, size)).model.layers[0].mlp.experts for r in range(size)]
    assert [r.width for r in ranks] == ([64, 32] if size == 2 else [32, 32, 32])
    x = torch.randn(10, whole.experts.w13_blocks.shape[2] * 32, generator=torch.Generator().manual_seed(1))
    weights, ids = route(whole.router(x), 2, renormalize=False)
    expected = whole.experts(x, weights, ids)  # thousands: float32 sums in another order differ in the 6th digit
    torch.testing.assert_close(sum(r(x, weights, ids) for r in ranks), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("shard, message", [
    (Shard(), r"no tensor for parameters \['model.layers.1.mlp.experts.down_proj_scales'\]"),  # packed
    (Shard(1, 4), r"lack their other half: \['model.layers.1.mlp.experts.down_proj_scales'\]")])  # dequantized
def test_a_half_missing_is_named(tmp_path, shard, message):
    write_mxfp4_checkpoint(tmp_path, drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path, shard)


@pytest.mark.parametrize("quant", [{"quant_method": "awq", "bits": 4}, "mxfp4"])
def test_other_quantizations_are_refused_naming_the_method(tmp_path, quant):
    make_gpt_oss().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method .* is not supported for GptOssForCausalLM .*mxfp4"):
        load_model_config(tmp_path)
