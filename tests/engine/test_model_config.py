"""ModelConfig.from_hf on config.json files written by transformers' own `save_pretrained`:
which layers have a sliding window, and the fields of Gemma 2, Granite, OLMo, EXAONE 4, GLM-4, Cohere,
SmolLM3, Helium, Seed-OSS, Ernie 4.5, HunYuan and Granite 4."""
import json
import re

import pytest

from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.loader import load_model_config
from tests.engine.test_loader import SHAPE, make_qwen2

def test_sliding_layers_from_layer_types_or_as_transformers_derives_them(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from splitserve.engine.model_builder import resolve_max_model_len

    make_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert (cfg.sliding_window, cfg.sliding_layers) == (8, (1,))
    assert [cfg.window_of(i) for i in range(2)] == [None, 8]
    assert resolve_max_model_len(cfg, None) == 128  # the window caps no context
    raw = json.loads((tmp_path / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k != "layer_types"}  # a transformers 4 config.json
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert load_model_config(tmp_path).sliding_layers == (1,)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "layer_types": ["full_attention", "dense"]}))
    with pytest.raises(ConfigError, match="layer_types must list 2 of"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 0}))
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer"):
        load_model_config(tmp_path)
    MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=8)).save_pretrained(tmp_path / "mistral")
    assert load_model_config(tmp_path / "mistral").sliding_layers == (0, 1)  # every layer


def test_gemma2_config_fields(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=16, query_pre_attn_scalar=20)).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert (cfg.gemma_norms, cfg.hidden_act, cfg.attention_scale) == (True, "gelu_pytorch_tanh", 20 ** -0.5)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.sliding_layers) == (50.0, 30.0, (0,))
    assert cfg.tie_word_embeddings
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "final_logit_softcapping": None,
                                                      "attn_logit_softcapping": None}))
    cfg = load_model_config(tmp_path)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attn_logit_softcapping": -1}))
    with pytest.raises(ConfigError, match="attn_logit_softcapping must be a positive number"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "hidden_activation": "relu"}))
    with pytest.raises(ConfigError, match="hidden activation 'relu' is not supported"):
        load_model_config(tmp_path)


def test_granite_config_fields(tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    GraniteForCausalLM(GraniteConfig(**SHAPE, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                                     attention_multiplier=0.015625)).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scale) == (12.0, 0.22, 0.125)
    assert cfg.attention_scale == 0.015625 and not cfg.attention_out_bias
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "logits_scaling": 0}))
    with pytest.raises(ConfigError, match="logits_scaling must be a positive number"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "mlp_bias": True}))
    assert load_model_config(tmp_path).mlp_bias  # Granite's MLP reads it (as Llama's, Helium's, Seed-OSS's)
    mistral = {**raw, "mlp_bias": True, "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    with pytest.raises(ConfigError, match="mlp_bias=true is not supported for MistralForCausalLM"):
        load_model_config(tmp_path)


def test_olmo3_from_a_transformers_4_config(tmp_path):
    """A hub OLMo 3 config.json (transformers 4): top-level rope_theta and rope_scaling, which are
    the full-attention layers'; the sliding ones turn at that base unscaled; no layer_types (all
    but every fourth layer slides) and, where it names none, a 4096-token window."""
    raw = {**BASE, "architectures": ["Olmo3ForCausalLM"], "num_hidden_layers": 8, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (0, 1, 2, 4, 5, 6))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.rope_type) == (500000.0, 500000.0, "yarn")
    assert cfg.norms_after and cfg.qk_norm and cfg.qk_norm_across_heads
    full = {**raw, "sliding_window": 32, "layer_types": ["full_attention"] * 8}
    assert ModelConfig.from_hf(full).sliding_layers == ()
    per_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ConfigError, match="sliding_attention rope_type 'linear' is not supported"):
        ModelConfig.from_hf({**raw, "rope_scaling": None, "rope_parameters": per_type})


@pytest.mark.parametrize("pattern, sliding", [(4, (0, 1, 2, 4, 5, 6)), ("LLLG", (0, 1, 2, 4, 5, 6)),
                                              ("LG", (0, 2, 4, 6)), ("L", (0, 1, 2, 3, 4, 5, 6))])
def test_exaone4_windows_and_layers_without_rope_from_its_pattern(pattern, sliding):
    """A hub EXAONE 4 config.json without layer_types: sliding_window_pattern says which layers
    slide (a string's last layer is full); the full ones attend without a rotary embedding, but
    only in a model with a window."""
    raw = {**BASE, "architectures": ["Exaone4ForCausalLM"], "num_hidden_layers": 8, "sliding_window_pattern": pattern}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, sliding)
    assert cfg.nope_layers == tuple(i for i in range(8) if i not in sliding)
    assert cfg.norms_after and cfg.qk_norm and not cfg.qk_norm_across_heads
    plain = ModelConfig.from_hf({**raw, "sliding_window": None})
    assert (plain.sliding_window, plain.nope_layers) == (None, ())
    for bad in (0, "LXG", ""):
        with pytest.raises(ConfigError, match="sliding_window_pattern must be a positive integer or a string of L"):
            ModelConfig.from_hf({**raw, "sliding_window_pattern": bad})


def test_glm4_defaults_as_transformers_reads_them():
    """A GLM-4 config.json that names neither: q/k/v biases (no o_proj bias) and half of each head
    turned, in neighbouring pairs."""
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Glm4ForCausalLM"], "head_dim": 16})
    assert (cfg.attention_bias, cfg.attention_out_bias, cfg.rotary_dim, cfg.rotary_interleaved) == (
        True, False, 8, True)
    assert ModelConfig.from_hf({**BASE, "architectures": ["Glm4ForCausalLM"], "attention_bias": False,
                                "partial_rotary_factor": 1.0}).rotary_dim == 8  # BASE: 32 / 4 heads


@pytest.mark.parametrize("arch, config_class", [("HeliumForCausalLM", "HeliumConfig"),
                                                ("SeedOssForCausalLM", "SeedOssConfig"),
                                                ("Ernie4_5ForCausalLM", "Ernie4_5Config")])
def test_a_family_config_class_fills_what_a_config_leaves_out(arch, config_class):
    """A config.json without head_dim, rope_theta, rms_norm_eps, ties or biases: the values
    transformers' config class of the family fills in (each unlike Llama's in one of them)."""
    import transformers

    theirs = getattr(transformers, config_class)(**{k: v for k, v in BASE.items() if k != "architectures"})
    ours = ModelConfig.from_hf({**BASE, "architectures": [arch]})
    assert (ours.head_dim, ours.rope_theta, ours.rms_norm_eps, ours.tie_word_embeddings) == (
        theirs.head_dim, theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps, theirs.tie_word_embeddings)
    assert (ours.attention_bias, ours.attention_out_bias, ours.mlp_bias) == tuple(
        getattr(theirs, name, getattr(theirs, "use_bias", False))
        for name in ("attention_bias", "attention_out_bias", "mlp_bias"))


def test_cohere_config_as_transformers_reads_it():
    """A hub Command R / Aya config.json: layer_norm_eps is the norms' eps, the embeddings are tied
    and the logits scaled by 0.0625 where it names neither; Command R+'s per-head q/k LayerNorms by
    use_qk_norm; Command R7B's window on all but every sliding_window_pattern-th layer, those without
    rotary embedding."""
    cohere = ModelConfig.from_hf({**BASE, "architectures": ["CohereForCausalLM"], "layer_norm_eps": 1e-3})
    assert (cohere.rms_norm_eps, cohere.tie_word_embeddings, cohere.logits_scale) == (1e-3, True, 0.0625)
    assert cohere.layer_norms and cohere.parallel_block and cohere.rotary_interleaved and cohere.sliding_window is None
    assert ModelConfig.from_hf({**BASE, "architectures": ["CohereForCausalLM"], "use_qk_norm": True}).qk_norm
    r7b = ModelConfig.from_hf({**BASE, "architectures": ["Cohere2ForCausalLM"], "num_hidden_layers": 8,
                               "sliding_window_pattern": 4})
    assert (r7b.sliding_window, r7b.sliding_layers, r7b.nope_layers) == (4096, (0, 1, 2, 4, 5, 6), (3, 7))


def test_smollm3_layers_without_rope(tmp_path):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    SmolLM3ForCausalLM(SmolLM3Config(**{**SHAPE, "num_hidden_layers": 8}, pad_token_id=None)).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert load_model_config(tmp_path).nope_layers == (3, 7)  # transformers: every fourth
    legacy = {k: v for k, v in raw.items() if k != "no_rope_layers"}
    assert ModelConfig.from_hf({**legacy, "no_rope_layer_interval": 2}).nope_layers == (1, 3, 5, 7)
    # a window only with use_sliding_window; without layer_types, on the layers without rope
    windowed = {k: v for k, v in raw.items() if k != "layer_types"}
    assert ModelConfig.from_hf({**windowed, "sliding_window": 16}).sliding_window is None
    cfg = ModelConfig.from_hf({**windowed, "sliding_window": 16, "use_sliding_window": True})
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, (3, 7))
    for bad in ([1, 0], [1, 2] * 4, [True] * 8):
        with pytest.raises(ConfigError, match="no_rope_layers must list 8 flags of 0 or 1"):
            ModelConfig.from_hf({**raw, "no_rope_layers": bad})


@pytest.mark.parametrize("quant", [{"quant_method": "gptq", "bits": 4}, {"quant_method": "mxfp4"}])
def test_a_quantized_checkpoint_of_an_architecture_without_that_format_is_refused(tmp_path, quant):
    """Weights the loader would read as if unquantized (or not find): refused before any load."""
    make_qwen2().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
    with pytest.raises(ConfigError, match=f"quant_method '{quant['quant_method']}' is not supported for Qwen2ForCausalLM"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size"])
def test_mxfp4_needs_whole_groups_of_32(field):
    """An MXFP4 checkpoint's experts read 32 values a scale, along hidden (gate, up) and the width (down)."""
    raw = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "quantization_config": {"quant_method": "mxfp4"}}
    assert ModelConfig.from_hf(raw).quantization == "mxfp4"
    with pytest.raises(ConfigError, match=f"{field}=48 is not a multiple of 32"):
        ModelConfig.from_hf({**raw, field: 48})


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_hidden_layers": -3}, "num_hidden_layers must be a positive integer"),
    ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer"),
    ({"hidden_size": [64]}, "hidden_size must be a positive integer"),
    ({"max_position_embeddings": -10}, "max_position_embeddings must be a positive integer"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a positive number"),
    ({"rope_theta": 0}, "rope_theta must be a positive number"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object or null"),
    ({"rope_parameters": "x"}, "rope_parameters must be an object or null"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling factor must be positive"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "is not a finite float"),
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 0}},
     "original_max_position_embeddings must be positive"),
    ({"rope_scaling": {"rope_type": "yarn"}, "original_max_position_embeddings": 0},
     "original_max_position_embeddings must be a positive integer"),
    ({"architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": -1}, "query_pre_attn_scalar must be a positive"),
])
def test_a_shape_or_number_no_model_can_have_is_refused_naming_it(fields, message):
    """Where it would divide by zero, build an empty model, or run and write garbage."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**BASE, **fields})
    assert ModelConfig.from_hf(BASE).num_key_value_heads == 2


def test_hunyuan_rope_alpha_from_a_hub_config():
    """A hub HunYuan config.json (transformers 4's rope_scaling, type "dynamic" with an alpha):
    the default rope at the base transformers computes (rope_theta * alpha ** (d / (d - 2))); a
    dynamic rope without an alpha, which grows with the sequence, stays refused."""
    raw = {**BASE, "architectures": ["HunYuanDenseV1ForCausalLM"], "head_dim": 16, "rope_theta": 10000.0,
           "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope_scaling.rope_type == "default" and cfg.qk_norm and cfg.qk_norm_after_rotary
    assert cfg.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
    assert cfg.weight_renames == ((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm."))
    with pytest.raises(ConfigError, match="type 'dynamic' is not supported"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


GRANITE4 = {**BASE, "architectures": ["GraniteMoeHybridForCausalLM"], "shared_intermediate_size": 48,
            "num_local_experts": 0, "layer_types": ["attention", "attention"], "position_embedding_type": "rope"}


def test_granite4_dense_checkpoints_and_the_hybrid_ones_refused():
    """Granite 4's dense checkpoints (every layer attention, no experts) are Granite's layers with
    an MLP shared_intermediate_size wide; without position_embedding_type "rope" (transformers'
    default) no layer is rotated; Mamba layers, an all-Mamba default and experts are refused."""
    cfg = ModelConfig.from_hf({**GRANITE4, "embedding_multiplier": 12.0})
    assert (cfg.intermediate_size, cfg.embedding_multiplier, cfg.nope_layers) == (48, 12.0, ())
    assert ModelConfig.from_hf({**GRANITE4, "position_embedding_type": None}).nope_layers == (0, 1)
    for fields, message in [({"layer_types": ["mamba", "attention"]}, r"layer_types \['mamba'\] are not supported"),
                            ({"layer_types": None}, "Mamba layers"),
                            ({"num_local_experts": 4}, "num_local_experts=4 is not supported")]:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf({**GRANITE4, **fields})


def test_internlm3_biases_by_its_hub_names():
    """InternLM3's hub config.json names the biases qkv_bias and bias; transformers (a Llama under
    its config) takes one setting for both, so a config where they differ is refused."""
    raw = {**BASE, "architectures": ["InternLM3ForCausalLM"], "qkv_bias": True, "bias": True}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias, cfg.head_dim) == (True, True, True, 128)
    with pytest.raises(ConfigError, match="qkv_bias=True and bias=False must agree"):
        ModelConfig.from_hf({**raw, "bias": False})


def test_activations_of_mlps_with_and_without_a_gate():
    """Arcee's, Apertus's and Nemotron's MLPs have no gate (their activation, relu2 by default, on
    up_proj alone); a Llama's activation is its gate's, so relu2 there is refused rather than read
    as ungated; the model builds an activation for every ungated name the config takes."""
    from splitserve.engine.config import UNGATED_ACTIVATIONS
    from splitserve.engine.model.activations import UNGATED

    assert set(UNGATED) == set(UNGATED_ACTIVATIONS)
    arcee = ModelConfig.from_hf({**BASE, "architectures": ["ArceeForCausalLM"]})
    assert (arcee.hidden_act, arcee.mlp_gated) == ("relu2", False)
    apertus = ModelConfig.from_hf({**BASE, "architectures": ["ApertusForCausalLM"], "hidden_act": "xielu"})
    assert (apertus.hidden_act, apertus.mlp_gated, apertus.qk_norm, apertus.rope_theta) == ("xielu", False, True, 12e6)
    with pytest.raises(ConfigError, match="hidden activation 'relu2' is not supported; supported: silu"):
        ModelConfig.from_hf({**BASE, "hidden_act": "relu2"})
    with pytest.raises(ConfigError, match="hidden activation 'silu' is not supported; supported: relu2, xielu"):
        ModelConfig.from_hf({**BASE, "architectures": ["ArceeForCausalLM"], "hidden_act": "silu"})


def test_nemotron_config_as_transformers_reads_it():
    """A hub Nemotron (Minitron) config.json: norm_eps is its LayerNorm1P's eps, half of each head
    turns where it names no partial_rotary_factor, and o_proj's and the MLP's biases follow
    attention_bias and mlp_bias."""
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["NemotronForCausalLM"], "norm_eps": 1e-3,
                               "attention_bias": True, "mlp_bias": True})
    assert (cfg.rms_norm_eps, cfg.layer_norms, cfg.layer_norm_1p, cfg.rotary_dim, cfg.mlp_gated) == (
        1e-3, True, True, 4, False)
    assert cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias and cfg.hidden_act == "relu2"
