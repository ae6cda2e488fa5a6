"""Mixture-of-experts checkpoints written by transformers' own `save_pretrained` (Mixtral,
Qwen2-MoE, Qwen3-MoE): the per-expert tensors load into the stacked experts, and the MoE fields of
config.json are read, or refused naming the field."""
import json

import pytest
import torch
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from splitserve.engine.config import ConfigError
from splitserve.engine.loader import iter_checkpoint_tensors, load_model_config, load_weights
from tests.engine.test_loader import SHAPE

MOE_SHAPE = dict(SHAPE, num_hidden_layers=3, num_experts_per_tok=2)


def make_mixtral(seed=0, **overrides):
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**{**MOE_SHAPE, "num_local_experts": 4, **overrides})).eval()


def make_qwen3_moe(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE_SHAPE, "num_experts": 6, "moe_intermediate_size": 24,
                                                 "mlp_only_layers": [1], **overrides})).eval()


def make_qwen2_moe(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**MOE_SHAPE, "num_experts": 4, "moe_intermediate_size": 24,
                                                 "shared_expert_intermediate_size": 40, **overrides})).eval()


@pytest.mark.parametrize("make, names", [(make_mixtral, "block_sparse_moe.experts.3.w3.weight"),
                                         (make_qwen3_moe, "mlp.experts.5.up_proj.weight"),
                                         (make_qwen2_moe, "mlp.shared_expert.down_proj.weight")])
def test_moe_experts_load_from_their_per_expert_tensors(tmp_path, make, names):
    """The hub stores each expert's projections as tensors of their own (what save_pretrained
    writes); ours are the same rows stacked, as transformers holds them; a dense layer of Qwen3-MoE
    (mlp_only_layers) keeps its plain MLP; Qwen2-MoE's shared expert and its gate load too."""
    from splitserve.engine.model.llama import LlamaForCausalLM as Ours
    from splitserve.engine.model.moe import SparseMoeBlock

    source = make()
    source.save_pretrained(tmp_path)
    assert f"model.layers.0.{names}" in {name for name, _ in iter_checkpoint_tensors(tmp_path)}
    ours = Ours(load_model_config(tmp_path), max_model_len=64)
    load_weights(ours, tmp_path)
    for i, (mine, theirs) in enumerate(zip(ours.model.layers, source.model.layers)):
        block = mine._modules[mine.mlp_name]
        if not isinstance(block, SparseMoeBlock):
            assert i == 1 and make is make_qwen3_moe
            assert torch.equal(block.gate_up_proj.weight, torch.cat([theirs.mlp.gate_proj.weight,
                                                                     theirs.mlp.up_proj.weight]))
            continue
        hf = getattr(theirs, "block_sparse_moe", None) or theirs.mlp
        assert torch.equal(block.gate.weight, hf.gate.weight)
        assert torch.equal(block.experts.w13, hf.experts.gate_up_proj)
        assert torch.equal(block.experts.w2, hf.experts.down_proj)
        if make is make_qwen2_moe:
            assert torch.equal(block.shared_expert_gate.weight, hf.shared_expert_gate.weight)
            assert torch.equal(block.shared_expert.down_proj.weight, hf.shared_expert.down_proj.weight)
        else:
            assert block.shared_expert is None


def test_moe_config_fields(tmp_path):
    make_mixtral().save_pretrained(tmp_path / "mixtral")
    mixtral = load_model_config(tmp_path / "mixtral")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 48)
    assert mixtral.norm_topk_prob and mixtral.dense_layers == ()
    make_qwen3_moe(num_hidden_layers=6, decoder_sparse_step=2, norm_topk_prob=True).save_pretrained(tmp_path / "qwen")
    qwen = load_model_config(tmp_path / "qwen")
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == (6, 24, True, True)
    assert qwen.dense_layers == (0, 1, 2, 4)  # off the step (0, 2, 4) and listed (1)
    assert [qwen.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    make_qwen2_moe(qkv_bias=False).save_pretrained(tmp_path / "qwen2")
    qwen2 = load_model_config(tmp_path / "qwen2")
    assert (qwen2.shared_expert_intermediate_size, qwen2.attention_bias, qwen2.qk_norm) == (40, False, False)
    assert qwen.shared_expert_intermediate_size == mixtral.shared_expert_intermediate_size == 0


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 7, "num_experts_per_tok=7 exceeds num_experts=6"),
    ("num_experts", 0, "num_experts must be a positive integer"),
    ("moe_intermediate_size", None, "moe_intermediate_size must be a positive integer"),
    ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer"),
    ("mlp_only_layers", "1", "mlp_only_layers must be a list")])
def test_bad_moe_config_names_the_field(tmp_path, field, value, message):
    make_qwen3_moe().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("num_local_experts", None)
    cfg.update({"num_experts": 6, field: value})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_model_config(tmp_path)
