"""What a model family's config.json adds to the Llama shape, read as transformers reads it:
Gemma's norms, scales and soft caps; Granite's multipliers; OLMo's norms after each sublayer and
across heads; EXAONE 4's after each sublayer; SmolLM3's layers without a rotary embedding;
Ministral 3's queries scaled by position; Cohere's LayerNorms, parallel block and logit scale;
MiniMax-M2's norms across heads; the GLMs', Helium's and Ernie 4.5's rotary pairs; Seed-OSS's,
Ernie 4.5's and InternLM3's biases; Arcee's, Apertus's and Nemotron's MLPs without a gate
(Apertus's norms renamed; Nemotron's LayerNorms with a bias and 1 + weight); HunYuan's q and k
norms after the rotation, and its rotary base raised by `alpha` (`ntk_alpha_base`); Granite 4's
dense checkpoints (every layer attention, no experts) as Granite's with its MLP renamed.
`family_fields` gives (the rope parameters the full-attention layers turn by, the family's
ModelConfig fields, which override the common ones and the shape's); `FIELD_DEFAULTS`,
transformers' defaults of a family's config class where they are not Llama's (what a hub
config.json may leave out)."""
from __future__ import annotations

from splitserve.engine.config_error import ConfigError, positive_float, positive_int, positive_number
from splitserve.engine.moe_config import ERNIE45_MOE, GLM4_MOE, MINIMAX_M2

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
GRANITE, SMOLLM3, EXAONE4 = "GraniteForCausalLM", "SmolLM3ForCausalLM", "Exaone4ForCausalLM"
COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")
MINISTRAL3, GLM4 = "Ministral3ForCausalLM", "Glm4ForCausalLM"
HELIUM, SEED_OSS, ERNIE45 = "HeliumForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM"
HUNYUAN, GRANITE4 = "HunYuanDenseV1ForCausalLM", "GraniteMoeHybridForCausalLM"
INTERNLM3, ARCEE, APERTUS = "InternLM3ForCausalLM", "ArceeForCausalLM", "ApertusForCausalLM"
NEMOTRON = "NemotronForCausalLM"
UNGATED_ARCHITECTURES = (ARCEE, APERTUS, NEMOTRON)  # their MLPs: up_proj, an activation without a gate, down_proj
ATTENTION_LAYER_TYPES = ("attention", "full_attention")  # Granite 4's layers of attention (the others: Mamba)
HALF_ROTARY = (GLM4, GLM4_MOE, NEMOTRON)  # transformers turns half of each head where the config names no share
UNROTATED_FULL_LAYERS = (EXAONE4, "Cohere2ForCausalLM")  # with a window, the full layers turn neither q nor k
WINDOWED = ("Olmo3ForCausalLM", EXAONE4, "Cohere2ForCausalLM")  # a window of 4096 where the config names none
PATTERN_DEFAULTS = {"Gemma3ForCausalLM": 6, "Olmo3ForCausalLM": 4, EXAONE4: 4, "Cohere2ForCausalLM": 4}
MLP_BIAS_ARCHITECTURES = ("LlamaForCausalLM", GRANITE, HELIUM, SEED_OSS, INTERNLM3, ARCEE, NEMOTRON)  # read mlp_bias
FIELD_DEFAULTS = {
    "Qwen2ForCausalLM": dict(attention_bias=True), GLM4: dict(attention_bias=True),
    **{arch: dict(tie_word_embeddings=True) for arch in COHERE_ARCHITECTURES},
    HELIUM: dict(head_dim=128, rope_theta=100_000.0, rms_norm_eps=1e-8),
    SEED_OSS: dict(head_dim=128, attention_bias=True),
    INTERNLM3: dict(head_dim=128, rms_norm_eps=1e-5),
    APERTUS: dict(rope_theta=12_000_000.0, rms_norm_eps=1e-5),
    ERNIE45: dict(head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    ERNIE45_MOE: dict(rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),  # heads: hidden / count
    MINIMAX_M2: dict(head_dim=128, rope_theta=5_000_000.0),
}


def family_fields(cfg: dict, arch: str, source: str, head_dim: int, layers: int, rope: dict) -> tuple[dict, dict]:
    """`rope`: the config's rope_parameters (transformers 5), {} where it has none."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma(cfg, arch, source, head_dim)
    if arch == GRANITE:
        return rope, _granite(cfg, source)
    if arch == GRANITE4:
        return rope, {**_granite(cfg, source), **_granite4(cfg, source, layers)}
    if arch == MINIMAX_M2:  # OLMo's q and k norms across heads (whatever use_qk_norm says, as transformers)
        return rope, dict(qk_norm_across_heads=True)
    if arch in OLMO_ARCHITECTURES:
        fields = dict(norms_after=True, qk_norm_across_heads=True)
        if arch == "Olmo2ForCausalLM":
            return rope, fields
        # OLMo 3: transformers 4's top-level rope_theta and rope_scaling are the full-attention layers'
        rope, local_theta = _per_layer_type(cfg, source, cfg.get("rope_theta", 500_000.0),
                                            cfg.get("rope_theta", 500_000.0))
        return rope, dict(fields, local_rope_theta=local_theta)
    if arch in COHERE_ARCHITECTURES:
        return rope, dict(layer_norms=True, parallel_block=True, rotary_interleaved=True,
                          qk_norm=bool(cfg.get("use_qk_norm")),  # Command R+'s, a LayerNorm per head
                          logits_scale=positive_float(cfg, "logit_scale", 0.0625, source),
                          rms_norm_eps=positive_float(cfg, "layer_norm_eps", 1e-5, source))
    fields = _llama_variant(cfg, arch, source)
    if fields is not None:
        return rope, fields
    if arch == GLM4_MOE:  # its per-head q and k norms are optional
        return rope, dict(qk_norm=bool(cfg.get("use_qk_norm")))
    if arch == EXAONE4:  # its layers without a rotary embedding: the full ones beside windowed (config.py)
        return rope, dict(norms_after=True)
    if arch == MINISTRAL3:  # Llama 4's scaling, its two numbers among the rope parameters
        params = rope or cfg.get("rope_scaling") or {}
        beta = positive_number(params, "llama_4_scaling_beta", None, source)
        if beta is None:
            return rope, {}
        original = params.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ConfigError(f"{source}: rope_parameters original_max_position_embeddings must be a positive "
                              f"integer with llama_4_scaling_beta, got {original!r}")
        return rope, dict(query_position_scale=(beta, original))
    if arch == SMOLLM3:
        return rope, dict(nope_layers=tuple(i for i, rotated in enumerate(_rope_layers(cfg, source, layers))
                                            if not rotated))
    return rope, {}


def _llama_variant(cfg: dict, arch: str, source: str) -> dict | None:
    """The fields of the families that are Llama's layers with a difference or two (GLM-4's and
    Helium's rotary pairs, Ernie's and InternLM3's biases, Seed-OSS's o_proj bias, Nemotron's
    LayerNorm1P, Apertus's and HunYuan's norms under their own names); None for any other."""
    if arch in (GLM4, HELIUM):
        return dict(rotary_interleaved=True)
    if arch in (ERNIE45, ERNIE45_MOE):  # use_bias: on every projection
        biased = bool(cfg.get("use_bias"))
        if biased and arch == ERNIE45_MOE:
            raise ConfigError(f"{source}: use_bias=true is not supported for {arch} (its LM head's bias)")
        return dict(rotary_interleaved=True, attention_bias=biased, attention_out_bias=biased, mlp_bias=biased)
    if arch == SEED_OSS:
        return dict(attention_out_bias=bool(cfg.get("attention_out_bias")))
    if arch == NEMOTRON:  # LayerNorm1P: a bias, and 1 + weight; its eps named norm_eps
        return dict(layer_norms=True, layer_norm_1p=True,
                    rms_norm_eps=positive_float(cfg, "norm_eps", 1e-5, source))
    if arch == APERTUS:  # Llama's two norms a layer under its own names
        return dict(weight_renames=((".attention_layernorm.", ".input_layernorm."),
                                    (".feedforward_layernorm.", ".post_attention_layernorm.")))
    if arch == INTERNLM3:  # transformers serves it as a Llama; its hub config names the biases qkv_bias and bias
        attention, mlp = (bool(cfg.get(name, cfg.get(alias))) for name, alias in (("attention_bias", "qkv_bias"),
                                                                                  ("mlp_bias", "bias")))
        if attention != mlp:
            raise ConfigError(f"{source}: qkv_bias={attention} and bias={mlp} must agree for {arch} (as "
                              "transformers requires: one setting biases q, k, v, o and the MLP)")
        return dict(attention_bias=attention, attention_out_bias=attention, mlp_bias=mlp)
    if arch == HUNYUAN:  # its per-head norms, under its own names, whatever use_qk_norm says (as transformers)
        return dict(qk_norm_after_rotary=True,
                    weight_renames=((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm.")))
    return None


def _granite(cfg: dict, source: str) -> dict:
    return dict(embedding_multiplier=positive_float(cfg, "embedding_multiplier", 1.0, source),
                residual_multiplier=positive_float(cfg, "residual_multiplier", 1.0, source),
                logits_scale=1 / positive_float(cfg, "logits_scaling", 1.0, source),
                attention_scale=positive_float(cfg, "attention_multiplier", 1.0, source))


def _granite4(cfg: dict, source: str, layers: int) -> dict:
    """Granite 4 (GraniteMoeHybrid) without Mamba layers or experts (granite-4.0-micro, -1b,
    -350m): its `shared_mlp` is the layer's MLP, shared_intermediate_size wide, its `input_linear`
    the fused gate and up; without position_embedding_type "rope" no layer turns q and k."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or []  # none: transformers' all-Mamba default
    others = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES} if types else {"mamba"})
    if others:
        raise ConfigError(f"{source}: layer_types {others!r} are not supported (Granite 4's Mamba layers); "
                          "its dense checkpoints, every layer attention, are")
    if cfg.get("num_local_experts"):
        raise ConfigError(f"{source}: num_local_experts={cfg['num_local_experts']!r} is not supported for {GRANITE4} "
                          "(its sparse layers)")
    fields = dict(intermediate_size=positive_int(cfg.get("shared_intermediate_size"), "shared_intermediate_size",
                                                 source),
                  weight_renames=((".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
                                  (".shared_mlp.output_linear.", ".mlp.down_proj.")))
    return fields if cfg.get("position_embedding_type") == "rope" else dict(fields, nope_layers=tuple(range(layers)))


def _gemma(cfg: dict, arch: str, source: str, head_dim: int) -> tuple[dict, dict]:
    """Gemma 2's soft caps default to 50 and 30, Gemma 3's to none; Gemma 3's sliding layers turn
    at their own base (rope_local_base_freq in a transformers 4 config) and its global ones default
    to a base of 1e6."""
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true is not supported (an encoder's attention)")
    fields = dict(gemma_norms=True,
                  attention_scale=(positive_number(cfg, "query_pre_attn_scalar", None, source) or head_dim) ** -0.5)
    if arch == "Gemma2ForCausalLM":
        return cfg.get("rope_parameters") or {}, dict(
            fields, attn_logit_softcap=positive_number(cfg, "attn_logit_softcapping", 50.0, source),
            final_logit_softcap=positive_number(cfg, "final_logit_softcapping", 30.0, source))
    rope, local_theta = _per_layer_type(cfg, source, cfg.get("rope_theta", 1_000_000.0),
                                        cfg.get("rope_local_base_freq", 10_000.0))
    return rope, dict(fields, attn_logit_softcap=positive_number(cfg, "attn_logit_softcapping", None, source),
                      final_logit_softcap=positive_number(cfg, "final_logit_softcapping", None, source),
                      local_rope_theta=local_theta)


def _per_layer_type(cfg: dict, source: str, full_theta, sliding_theta) -> tuple[dict, float]:
    """(the full-attention layers' rope parameters, the sliding layers' base) from transformers 5's
    rope_parameters per layer type, else these defaults; the sliding layers turn unscaled."""
    rope = cfg.get("rope_parameters") or {}
    per_type = rope if "full_attention" in rope or "sliding_attention" in rope else {}
    local = per_type.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"{source}: rope_parameters.sliding_attention rope_type {local['rope_type']!r} is not "
                          "supported (the sliding layers turn unscaled)")
    theta = local.get("rope_theta", sliding_theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{source}: the sliding layers' rope_theta must be a positive number, got {theta!r}")
    return {"rope_theta": full_theta, **(per_type.get("full_attention") or {})}, float(theta)


def _rope_layers(cfg: dict, source: str, layers: int) -> list[int]:
    """SmolLM3's no_rope_layers (1: the layer turns q and k, 0: it does not), or as transformers
    derives it: every no_rope_layer_interval-th layer without."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{source}: no_rope_layer_interval must be a positive integer, got {every!r}")
        return [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(isinstance(f, bool) or f not in (0, 1)
                                                                  for f in flags):
        raise ConfigError(f"{source}: no_rope_layers must list {layers} flags of 0 or 1, got {flags!r}")
    return flags


def ntk_alpha_base(cfg: dict, head_dim: int, source: str) -> dict:
    """HunYuan's "dynamic" rope with an `alpha` (in rope_parameters, or a transformers 4
    rope_scaling): as transformers reads it (its ntk_alpha), a fixed base rope_theta * alpha **
    (head_dim / (head_dim - 2)) for every position, the default rope otherwise; `cfg` so rewritten.
    A config without an alpha is returned as it is."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or params.get("alpha") is None:
        return cfg
    alpha = positive_float(params, "alpha", None, source)
    theta = positive_float(params if "rope_theta" in params else cfg, "rope_theta", 10000.0, source)
    return {**cfg, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta * alpha ** (head_dim / (head_dim - 2))}}
