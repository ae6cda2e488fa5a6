"""Mixture-of-experts checkpoints written by transformers' own `save_pretrained` (Mixtral,
Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5, Ernie 4.5, MiniMax-M2): the per-expert tensors load into the stacked
experts, and the MoE fields of config.json are read, or refused naming the field."""
import json

import pytest
import torch
from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.loader import CheckpointError, iter_checkpoint_tensors, load_model_config, load_weights
from tests.engine.hf_checkpoints import ENGINE_ARGS, tokenizers_by_kind, write_checkpoint  # noqa: F401 (fixture)
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


def make_gpt_oss(seed=0, **overrides):
    torch.manual_seed(seed)
    config = GptOssConfig(**{**MOE_SHAPE, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                             "num_local_experts": 4, "sliding_window": 8, **overrides})
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():  # transformers leaves biases and sinks at zero: draw them, so a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    return model


def test_gpt_oss_experts_load_from_their_stacked_tensors(tmp_path):
    """GPT-OSS stores all of a layer's experts as one [experts, in, out] tensor with gate and up
    columns alternating, biases beside them, and the router (with a bias) as `mlp.router`; the
    block run on the loaded weights equals transformers' own, clamp and biases included."""
    from splitserve.engine.model.llama import LlamaForCausalLM as Ours

    source = make_gpt_oss(swiglu_limit=1.0)  # low enough to bind on these activations
    source.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert (config.num_experts, config.moe_intermediate_size, config.swiglu_limit) == (4, 48, 1.0)
    assert config.attention_sinks and config.attention_bias and config.attention_out_bias
    assert config.sliding_layers == (0, 2) and config.rope_scaling.rope_type == "yarn"
    ours = Ours(config, max_model_len=64)
    load_weights(ours, tmp_path)
    x = torch.randn(7, MOE_SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3))
    for mine, theirs in zip(ours.model.layers, source.model.layers):
        assert torch.equal(mine.self_attn.sinks, theirs.self_attn.sinks)
        assert torch.equal(mine.self_attn.o_proj.bias, theirs.self_attn.o_proj.bias)
        with torch.no_grad():
            expected, _ = theirs.mlp(x[None])
            torch.testing.assert_close(mine.mlp(x), expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field, value, message", [
    ("swiglu_limit", -1.0, "swiglu_limit must be a positive number or null"),
    ("swiglu_alpha", None, "swiglu_alpha must be a positive number, got None"),
    ("num_experts_per_tok", 5, "num_experts_per_tok=5 exceeds num_experts=4")])
def test_bad_gpt_oss_config_names_the_field(tmp_path, field, value, message):
    make_gpt_oss().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ConfigError, match=message):
        load_model_config(tmp_path)


GLM = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "moe_intermediate_size": 16}


def test_glm4_moe_config_fields():
    """A hub GLM-4.5 config.json's MoE fields, and transformers' defaults for those it leaves out."""
    cfg = ModelConfig.from_hf({**GLM, "n_shared_experts": 2, "first_k_dense_replace": 2, "n_group": 4, "topk_group": 2,
                               "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "use_qk_norm": True,
                               "attention_bias": True, "partial_rotary_factor": 0.5})
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (8, 16, 32)
    assert (cfg.dense_layers, cfg.moe_groups, cfg.routed_scaling_factor, cfg.skipped_layers) == (
        (0, 1), (4, 2), 2.5, 1)
    assert cfg.qk_norm and cfg.attention_bias and not cfg.attention_out_bias and cfg.rotary_dim == 4
    plain = ModelConfig.from_hf(GLM)
    assert (plain.dense_layers, plain.moe_groups, plain.shared_expert_intermediate_size) == ((0,), (1, 1), 16)
    assert plain.norm_topk_prob and not plain.qk_norm and plain.rotary_dim == 4  # transformers turns half by default


@pytest.mark.parametrize("fields, message", [
    ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ({"n_group": 2, "topk_group": 3}, "n_group=2 must divide n_routed_experts=8 and be at least topk_group=3"),
    ({"n_group": 8}, "leaves groups of fewer than 2 experts"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group=1 groups hold fewer experts"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a positive number"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be an integer >= 0")])
def test_bad_glm4_moe_config_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**GLM, **fields})


def test_glm4_moe_multi_token_prediction_layers_are_skipped(tmp_path, tokenizers_by_kind):  # noqa: F811
    """GLM-4.5 stores its multi-token-prediction layer after the decoder's (num_nextn_predict_layers):
    not served, so skipped; a layer past those is still refused, naming it."""
    from safetensors.torch import load_file, save_file

    from splitserve.engine.llm_engine import LLMEngine

    write_checkpoint(tmp_path, "glm4_moe", tokenizers_by_kind)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(4, 4), "model.layers.2.mlp.experts.0.up_proj.weight":
           torch.zeros(4, 4)}
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert LLMEngine(str(tmp_path), **ENGINE_ARGS).model_config.skipped_layers == 1
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="model.layers.2"):
        LLMEngine(str(tmp_path), **ENGINE_ARGS)


ERNIE = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_num_experts": 8,
         "moe_k": 2, "moe_intermediate_size": 16}


def test_ernie45_moe_config_fields():
    """A hub ERNIE 4.5 MoE config.json's fields, and transformers' defaults for those it leaves out
    (the first layer dense, two shared experts, heads of hidden_size / their count, unlike the dense
    Ernie's 128 dims, tied embeddings); use_bias, which
    would bias its LM head, is refused naming it."""
    from transformers import Ernie4_5_MoeConfig

    plain = ModelConfig.from_hf(ERNIE)
    theirs = Ernie4_5_MoeConfig(**{k: v for k, v in ERNIE.items() if k != "architectures"})
    assert (plain.num_experts, plain.num_experts_per_tok) == (theirs.num_experts, theirs.num_experts_per_tok) == (8, 2)
    assert plain.dense_layers == (0,) and plain.shared_expert_intermediate_size == 32
    assert (plain.moe_choice_bias, plain.norm_topk_prob, plain.head_dim, plain.tie_word_embeddings) == (
        "softmax", True, 8, theirs.tie_word_embeddings)
    assert (plain.rope_theta, plain.rms_norm_eps) == (theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps)
    every_other = ModelConfig.from_hf({**ERNIE, "moe_layer_start_index": 2, "moe_layer_end_index": 4,
                                       "moe_layer_interval": 2, "moe_num_shared_experts": 0})
    assert every_other.dense_layers == (0, 1, 2, 4, 5) and every_other.shared_expert_intermediate_size == 0
    with pytest.raises(ConfigError, match="use_bias=true is not supported for Ernie4_5_MoeForCausalLM"):
        ModelConfig.from_hf({**ERNIE, "use_bias": True})
    with pytest.raises(ConfigError, match="moe_layer_interval must be a positive integer"):
        ModelConfig.from_hf({**ERNIE, "moe_layer_interval": 0})


def test_ernie45_moe_multi_token_prediction_tensors_are_skipped(tmp_path, tokenizers_by_kind):  # noqa: F811
    """ERNIE 4.5 MoE's hub checkpoints hold a multi-token-prediction block beside the decoder
    (`model.mtp_*`): not served, so skipped; any other unknown tensor is still refused by name."""
    from safetensors.torch import load_file, save_file

    from splitserve.engine.llm_engine import LLMEngine

    write_checkpoint(tmp_path, "ernie4_5_moe", tokenizers_by_kind)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {"model.mtp_block.0.mlp.up_proj.weight": torch.zeros(4, 4), "model.mtp_emb_norm.0.weight": torch.zeros(4),
           "model.mtp_linear_proj.0.weight": torch.zeros(4, 8)}
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    LLMEngine(str(tmp_path), **ENGINE_ARGS)
    save_file({**tensors, "model.extra_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.extra_proj.weight"):
        LLMEngine(str(tmp_path), **ENGINE_ARGS)


def test_minimax_m2_hub_config():
    """A hub MiniMax-M2 config.json (transformers 4's keys): rotary_dim turns that many dims of each
    head; q's and k's norms across heads; experts intermediate_size wide, chosen by a biased
    sigmoid; its multi-token-prediction modules (use_mtp), stored after the decoder's, skipped."""
    cfg = ModelConfig.from_hf({
        "architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 5000000, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "use_mtp": True, "num_mtp_modules": 3})
    assert (cfg.rotary_dim, cfg.qk_norm, cfg.qk_norm_across_heads, cfg.rope_theta) == (8, True, True, 5e6)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_choice_bias, cfg.norm_topk_prob) == (
        8, 16, "sigmoid", True)
    assert (cfg.dense_layers, cfg.shared_expert_intermediate_size, cfg.skipped_layers) == ((), 0, 3)
