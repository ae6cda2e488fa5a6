"""AutoAWQ's GEMM checkpoints (`engine/awq.py`): their tensors read as compressed-tensors' own
AutoAWQ converter writes them (bit for bit), and whole checkpoints in that layout giving the logits
transformers computes from the weights compressed-tensors decompresses after that conversion:
dense and MoE, with zero points and without, whole and over tensor-parallel ranks, dequantized at
load (the CPU path) or kept packed (built as on a GPU); its quantization_config read, other
layouts and widths refused naming the field."""
import pytest
import torch
from safetensors.torch import load_file

from splitserve.engine import awq, fp8
from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.int_weights import IntWeights
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_model_config
from splitserve.engine.model.sharding import Shard
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixture)
    ENGINE_ARGS, hf_logits, prompt_ids, rewrite_quantized, tokenizers_by_kind, write_checkpoint,
)
from tests.engine.runner_helpers import max_diff
from tests.engine.test_fp8 import load, prefill_logits, reference

GROUP = 16


def awq_config(group: int, zero_point: bool, **extra) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": zero_point, "version": "gemm",
            "modules_to_not_convert": None, **extra}


def awq_layer(rows: int, cols: int, group: int, zero_point: bool, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A layer [rows, cols] as AutoAWQ stores one: random words (every bit pattern a valid pack),
    zero points, and float16 scales that keep the weights about normal(0, 0.02)'s spread."""
    words = lambda r, c: torch.randint(-2**31, 2**31 - 1, (r, c), generator=g, dtype=torch.int64).to(torch.int32)
    layer = {"qweight": words(cols, rows // 8),
             "scales": (0.004 * (0.5 + torch.rand(cols // group, rows, generator=g))).half()}
    if zero_point:
        layer["qzeros"] = words(cols // group, rows // 8)
    return layer


def awq_checkpoint(path, name: str, tokenizers_by_kind, group: int, zero_point: bool, dense=None,
                   skip: str | None = None) -> None:
    """Write `name` with every attention, MLP and expert projection as AutoAWQ's tensors (but those
    whose name contains `skip`: its modules_to_not_convert); `dense`: a directory for the same model
    unquantized, each weight as compressed-tensors' AutoAWQ converter and its decompressor read it
    (in float32)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    write_checkpoint(path, name, tokenizers_by_kind)
    converter = AutoAWQConverter(group_size=group, zero_point=zero_point)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=not zero_point, strategy="group", group_size=group))
    g, tensors, decompressed = torch.Generator().manual_seed(7), {}, {}
    for tensor_name, tensor in load_file(path / "model.safetensors").items():
        if not (tensor_name.endswith("proj.weight") and tensor.dim() == 2) or (skip and skip in tensor_name):
            tensors[tensor_name] = decompressed[tensor_name] = tensor.contiguous()
            continue
        module = tensor_name.removesuffix(".weight")
        layer = {f"{module}.{part}": value for part, value in awq_layer(*tensor.shape, group, zero_point, g).items()}
        tensors.update(layer)
        state = {k.removeprefix(module + "."): v for k, v in converter.process(dict(layer)).items()}
        state["weight_scale"] = state["weight_scale"].float()  # exactly the float16 scales: float32 products
        decompressed[tensor_name] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(tensor.dtype)
    rewrite_quantized(path, tensors, awq_config(group, zero_point, modules_to_not_convert=skip and [skip]), dense,
                      decompressed)


@pytest.mark.parametrize("zero_point", [True, False])
def test_tensors_convert_as_compressed_tensors_converter_does(zero_point):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    layer = awq_layer(96, 64, 32, zero_point, torch.Generator().manual_seed(1))
    expected = AutoAWQConverter(group_size=32, zero_point=zero_point).process({f"m.{k}": v for k, v in layer.items()})
    ours = {name: awq.converted("." + name, tensor) for name, tensor in layer.items()}
    assert torch.equal(ours["qweight"], expected["m.weight_packed"])
    assert torch.equal(ours["scales"], expected["m.weight_scale"].float())
    assert ("qzeros" in ours) == zero_point
    if zero_point:
        assert torch.equal(ours["qzeros"], expected["m.weight_zero_point"])
    with pytest.raises(ValueError, match="int32"):
        awq.converted(".qweight", layer["qweight"].to(torch.int64))


@pytest.mark.parametrize("name, zero_point, skip", [("qwen3_qk_norm", True, None), ("llama3_gqa_tied", False, None),
                                                    ("qwen3_moe", True, None), ("qwen3_qk_norm", True, "down_proj")])
@pytest.mark.parametrize("kept", [False, True], ids=["cpu", "gpu-build"])
def test_an_awq_checkpoint_gives_transformers_logits(tmp_path, tokenizers_by_kind, monkeypatch, name, zero_point,
                                                     skip, kept):
    """Whole, and with a module AutoAWQ left unconverted (modules_to_not_convert: its weight stored
    unquantized)."""
    pytest.importorskip("compressed_tensors")
    packed = tmp_path / "awq"
    packed.mkdir()
    awq_checkpoint(packed, name, tokenizers_by_kind, GROUP, zero_point, dense=tmp_path / "dense", skip=skip)
    config = load_model_config(packed)
    assert (config.quantization, config.int_weights, config.int_layout) == \
        ("int", IntWeights(4, GROUP, not zero_point), "awq")
    if kept:
        monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    engine = LLMEngine(str(packed), dtype="float32", **ENGINE_ARGS)
    layer = engine.runner.model.model.layers[-1]
    assert (layer.self_attn.qkv_proj.ints is not None) == kept
    if name == "qwen3_moe":
        assert layer.mlp.experts.format == ("int" if kept else None)
    else:
        assert (layer.mlp.down_proj.ints is not None) == (kept and skip is None)
    hf = reference(tmp_path / "dense")
    ids = prompt_ids(1, 37, hf.config.vocab_size)
    ours, ref = prefill_logits(engine, ids), hf_logits(hf, ids)
    assert ref.std().item() > 0.1 and max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


@pytest.mark.parametrize("kept", [False, True], ids=["cpu", "gpu-build"])
def test_tensor_parallel_ranks_add_up_to_the_whole_model(tmp_path, tokenizers_by_kind, monkeypatch, kept):
    """Each rank takes its part of every converted tensor: a merged projection's rows, a row-parallel
    one's columns in whole words and groups, the experts' slices of their width."""
    pytest.importorskip("compressed_tensors")
    awq_checkpoint(tmp_path, "qwen3_moe", tokenizers_by_kind, GROUP, True)
    if kept:
        monkeypatch.setattr(fp8, "build_capability", lambda: (9, 0))
    whole = load(tmp_path).model.layers[-1]
    ranks = [load(tmp_path, Shard(rank, 2)).model.layers[-1] for rank in range(2)]
    assert (ranks[0].mlp.experts.format == "int") == kept
    x = torch.randn(3, whole.mlp.experts.w2.shape[1] if not kept else whole.mlp.experts.w2_packed.shape[1])
    assert max_diff(sum(rank.mlp(x) for rank in ranks), whole.mlp(x)) <= 1e-4
    y = torch.randn(3, whole.self_attn.o_proj.in_features)
    assert max_diff(sum(rank.self_attn.o_proj(y[:, rank.self_attn.o_proj.shard_slice.start:
                                                 rank.self_attn.o_proj.shard_slice.stop]) for rank in ranks),
                    whole.self_attn.o_proj(y)) <= 1e-4


BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 300}


@pytest.mark.parametrize("quant, field", [
    (awq_config(128, True, version="gemv"), "version 'gemv'"),
    (awq_config(128, True, version="exllama"), "version 'exllama'"),
    (awq_config(128, True, bits=8), "bits 8"),
    (awq_config(0, True), "group_size"),
    (awq_config(128, "yes"), "zero_point"),
    (awq_config(128, True, modules_to_not_convert=[3]), "modules_to_not_convert"),
])
def test_other_awq_layouts_are_refused_naming_the_field(quant, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf({**BASE, "quantization_config": quant}, source="config.json")


def test_modules_to_not_convert_name_modules_stored_unquantized():
    """AutoAWQ's rule: a module whose name contains one of them (so "mlp.gate", the router, takes
    gate_proj too, as AutoAWQ quantizes neither)."""
    config = ModelConfig.from_hf({**BASE, "quantization_config": awq_config(
        128, True, version="GEMM", modules_to_not_convert=["visual", "mlp.gate"])}, source="config.json")
    assert config.stored_unquantized("model.visual.blocks.0") and config.stored_unquantized("model.layers.0.mlp.gate")
    assert config.stored_unquantized("model.layers.0.mlp.gate_proj")
    assert not config.stored_unquantized("model.layers.0.self_attn.q_proj")
    assert not config.stored_unquantized("model.layers.0.mlp.up_proj")
