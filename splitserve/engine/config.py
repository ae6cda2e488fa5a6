"""The model's shape, frozen, from a Hugging Face `config.json` (the engine's knobs: `engine_config`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from splitserve.engine.config_error import ConfigError, positive_float, positive_int
from splitserve.engine.config_families import (APERTUS, COHERE_ARCHITECTURES, ERNIE45, EXAONE4, FIELD_DEFAULTS,
                                               GLM4, GRANITE4, HALF_ROTARY, HELIUM, HUNYUAN, INTERNLM3,
                                               MLP_BIAS_ARCHITECTURES, NEMOTRON, OLMO_ARCHITECTURES,
                                               PATTERN_DEFAULTS, SEED_OSS, SMOLLM3, UNGATED_ARCHITECTURES,
                                               UNROTATED_FULL_LAYERS, WINDOWED, family_fields, ntk_alpha_base)
from splitserve.engine.int_weights import IntWeights
from splitserve.engine.moe_config import ERNIE45_MOE, GLM4_MOE, MINIMAX_M2, parse_moe
from splitserve.engine.multimodal_text import WRAPPERS, text_config
from splitserve.engine.quantization_config import parse_quantization, stored_unquantized

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
                           "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM", "Exaone4ForCausalLM",
                           "Ministral3ForCausalLM", GLM4_MOE, GLM4, *COHERE_ARCHITECTURES, HELIUM, SEED_OSS,
                           ERNIE45, ERNIE45_MOE, MINIMAX_M2, HUNYUAN, GRANITE4, INTERNLM3, *UNGATED_ARCHITECTURES)
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", EXAONE4, *OLMO_ARCHITECTURES,
                         MINIMAX_M2, HUNYUAN, APERTUS)
# attention_bias puts a bias on o_proj too (transformers' classes); the others' o_proj never has one
O_PROJ_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                             "Gemma3ForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", GRANITE4, SMOLLM3,
                             NEMOTRON, *OLMO_ARCHITECTURES, *COHERE_ARCHITECTURES)  # (Seed-OSS's, Ernie's: their own)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",  # sparse expert MLPs
                     "GptOssForCausalLM", GLM4_MOE, ERNIE45_MOE, MINIMAX_M2)
# checkpoints store qkv_proj (Phi-3) and gate_up_proj (Phi-3, GLM-4, Granite 4) as one tensor each
FUSED_ARCHITECTURES = ("Phi3ForCausalLM", GLM4, GRANITE4)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: Llama's SiLU, Gemma's tanh-approximated GELU
UNGATED_ACTIVATIONS = ("relu2", "xielu")  # an MLP without a gate's (UNGATED_ARCHITECTURES): Arcee's, Apertus's


@dataclass(frozen=True)
class RopeScaling:
    """A config's rope_scaling (or transformers 5's rope_parameters), with transformers' defaults."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0   # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope: the context the model was trained for
    beta_fast: float = 32.0        # yarn: dimensions turning more often than this over that context are kept
    beta_slow: float = 1.0         # yarn: ... less often than this are interpolated (divided by factor)
    truncate: bool = True          # yarn: round the band between those outwards to whole dimensions
    attention_factor: float | None = None  # yarn: what cos and sin are scaled by; None: from factor (and mscale)
    mscale: float | None = None    # yarn (DeepSeek): with mscale_all_dim, the default attention_factor's terms
    mscale_all_dim: float | None = None
    short_factor: tuple[float, ...] = ()  # longrope: per frequency pair, what divides it within the trained context
    long_factor: tuple[float, ...] = ()   # longrope: ... past it


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rotary_dim: int = 0            # the leading dims of each head the rotary embedding turns (0: all)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False   # on the q, k and v projections
    attention_out_bias: bool = False  # on o_proj too (GPT-OSS; O_PROJ_BIAS_ARCHITECTURES with attention_bias)
    mlp_bias: bool = False         # on the dense MLPs' projections
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins every softmax (attention.base.Scoring)
    qk_norm: bool = False          # RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    qk_norm_across_heads: bool = False  # OLMo: ... over all of q's heads together, and k's (a weight per row)
    qk_norm_after_rotary: bool = False  # HunYuan: the per-head norms after the rotary embedding instead
    norms_after: bool = False      # OLMo: the attention's and the MLP's outputs are normalized before they join
    #                                the residual stream, their inputs not (no input_layernorm)
    embedding_multiplier: float = 1.0  # Granite: the embeddings are scaled by it
    residual_multiplier: float = 1.0   # Granite: the attention's and the MLP's outputs are scaled by it
    logits_scale: float = 1.0      # Granite, Cohere: the logits are multiplied by it
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that do not turn q and k (no rotary embedding)
    rotary_interleaved: bool = False  # GLM-4, Cohere, Helium, Ernie 4.5: the rotary embedding turns pairs of
    #                                neighbouring dims
    layer_norms: bool = False      # Cohere: the norms are LayerNorms (mean-centred, a weight and no bias)
    layer_norm_1p: bool = False    # Nemotron: ... with a bias, scaling by 1 + weight
    parallel_block: bool = False   # Cohere: the attention and the MLP read the same normed input; their
    #                                outputs join the residual stream together
    query_position_scale: tuple[float, int] | None = None  # Ministral 3 (Llama 4's), (beta, n): after the rotary
    #                                embedding q is scaled by 1 + beta * log(1 + floor(position / n))
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # a sliding layer's token attends to the latest this many positions (itself too)
    sliding_layers: tuple[int, ...] = ()  # the layers with the window; the others attend to the whole context
    num_experts: int = 0           # MoE: experts of each sparse layer (0: every MLP is dense)
    num_experts_per_tok: int = 0   # MoE: the experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # MoE: each expert's MLP width
    norm_topk_prob: bool = True    # MoE: the chosen experts' weights are renormalized to sum to one
    dense_layers: tuple[int, ...] = ()  # MoE: the layers whose MLP is dense (Qwen's mlp_only_layers, sparse step)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an MLP every token takes beside its experts, gated
    #                                (GLM-4.5's, moe_intermediate_size times n_shared_experts wide, ungated)
    moe_choice_bias: str | None = None  # GLM-4.5 (DeepSeek-V3's routing) "sigmoid", Ernie 4.5 "softmax": experts
    #                                chosen by that score of the router's logits plus a learned bias, weighted by it
    moe_groups: tuple[int, int] = (1, 1)  # GLM-4.5, (n_group, topk_group): chosen within the best groups
    routed_scaling_factor: float = 1.0  # GLM-4.5: the chosen experts' weights are scaled by it
    skipped_layers: int = 0        # GLM-4.5: multi-token-prediction layers stored after the decoder's, not served
    swiglu_limit: float | None = None  # GPT-OSS's experts: gate clamped to <= limit, up to [-limit, limit] (None: not)
    swiglu_alpha: float = 1.702    # GPT-OSS's experts: out = (up + 1) * gate * sigmoid(alpha * gate) (moe.GatedAct)
    hidden_act: str = "silu"       # the MLP gate's activation (ACTIVATIONS), or an ungated MLP's (UNGATED_ACTIVATIONS)
    mlp_gated: bool = True         # False: the MLP is up_proj, the activation, down_proj (Arcee, Apertus, Nemotron)
    attention_scale: float | None = None  # scores are q.k times this (None: head_dim ** -0.5)
    attn_logit_softcap: float | None = None   # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the logits likewise
    gemma_norms: bool = False      # Gemma 2, 3: RMSNorm scales by (1 + weight), in float32; the embeddings are
    #                                scaled by sqrt(hidden_size); the attention's and the MLP's outputs are
    #                                normalized too (four norms a layer)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rotary base (no scaling); None: rope_theta
    weights_prefix: str = ""       # a multimodal checkpoint's: what its language model's tensor names start with
    skipped_weights: tuple[str, ...] = ()  # the prefixes of the tensors not served (a vision tower, Ernie's MTP)
    weight_renames: tuple[tuple[str, str], ...] = ()  # (a part of the checkpoint's names, ours): HunYuan's norms
    quantization: str | None = None  # the checkpoint's weights' format (mxfp4, fp8, int); None: the model's dtype
    weight_block_size: tuple[int, int] | None = None  # FP8: the [rows, cols] each scale covers (None: a tensor or row)
    int_weights: IntWeights | None = None  # int: the packed integers' scheme (bits, group, zero points)
    int_layout: str | None = None  # int: "awq" for AutoAWQ's tensors (read as pack-quantized ones); None: those
    unquantized_modules: tuple[str, ...] = ()  # FP8, int: the modules stored unquantized (`quantization_config`)
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def max_positions(self) -> int:
        """The positions the model takes: max_position_embeddings, or with YaRN the trained context
        times the factor (as vLLM derives it: Qwen's YaRN recipe leaves max_position_embeddings)."""
        s = self.rope_scaling
        if s.rope_type == "yarn":
            return max(self.max_position_embeddings, int(s.original_max_position_embeddings * s.factor))
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has it (the KV cache then keeps only a window's blocks of a
        sequence: `BlockManager`), else None."""
        return self.sliding_window if len(self.sliding_layers) == self.num_hidden_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def stored_unquantized(self, module: str) -> bool:
        """Whether the checkpoint stores module `module` in its own dtype (`unquantized_modules`)."""
        return stored_unquantized(self.unquantized_modules, module)

    @property
    def long_rope_from(self) -> int | None:
        """longrope: a sequence of more tokens than this (the trained context) turns by the long
        factors, all of its tokens; None without longrope."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s.rope_type == "longrope" else None

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; unsupported or missing values raise ConfigError."""
        archs = cfg.get("architectures") or []
        wrapper = next((WRAPPERS[a] for a in archs if a in WRAPPERS), None)
        if wrapper is not None:
            return dataclasses.replace(cls.from_hf(text_config(cfg, wrapper, source), source),
                                       weights_prefix=wrapper.weights_prefix, skipped_weights=wrapper.skipped)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES + tuple(WRAPPERS))
            raise ConfigError(f"{source}: unsupported architectures {archs!r}; supported: {supported}")

        defaults = FIELD_DEFAULTS.get(arch, {})
        shape = _shape(cfg, source, defaults.get("head_dim"))
        layers, head_dim = shape["num_hidden_layers"], shape["head_dim"]
        if arch == HUNYUAN:
            cfg = ntk_alpha_base(cfg, head_dim, source)
        if cfg.get("mlp_bias") and arch not in MLP_BIAS_ARCHITECTURES:
            raise ConfigError(f"{source}: mlp_bias=true is not supported for {arch} (transformers' has no MLP biases)")
        rope = _mapping(cfg, "rope_parameters", source)  # transformers 5 keeps rope_theta and scaling here
        rope, family = family_fields(cfg, arch, source, head_dim, layers, rope)
        rotary_dim = _rotary_dim(cfg, rope, head_dim, source, 0.5 if arch in HALF_ROTARY else 1.0,
                                 cfg.get("rotary_dim") if arch == MINIMAX_M2 else None)
        window = _parse_window(cfg, arch, source, layers, family)
        if arch in UNROTATED_FULL_LAYERS and window:  # a hybrid's full layers attend without a rotary embedding
            family["nope_layers"] = tuple(i for i in range(layers) if i not in window["sliding_layers"])
        oss = arch == "GptOssForCausalLM"
        common = dict(  # what a family's fields may override (as they may the shape's)
            rms_norm_eps=positive_float(cfg, "rms_norm_eps", defaults.get("rms_norm_eps", 1e-6), source),
            rope_theta=positive_float(rope if "rope_theta" in rope else cfg, "rope_theta",
                                      defaults.get("rope_theta", 10000.0), source),
            rope_scaling=_parse_rope_scaling(_mapping(cfg, "rope_scaling", source) or rope, source,
                                             shape["max_position_embeddings"],
                                             cfg.get("original_max_position_embeddings"), rotary_dim // 2),
            attention_bias=bool(cfg.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                                else cfg.get("attention_bias", defaults.get("attention_bias", False))),
            attention_out_bias=arch in O_PROJ_BIAS_ARCHITECTURES and bool(cfg.get("attention_bias", oss)),
            mlp_bias=bool(cfg.get("mlp_bias")), attention_sinks=oss, qk_norm=arch in QK_NORM_ARCHITECTURES,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
            hidden_act=_activation(cfg, source, arch in UNGATED_ARCHITECTURES),
            mlp_gated=arch not in UNGATED_ARCHITECTURES,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"))
        return cls(architecture=arch, rotary_dim=rotary_dim, **{**shape, **common, **family}, **window,
                   **(parse_moe(cfg, arch, source, layers) if arch in MOE_ARCHITECTURES else {}),
                   **parse_quantization(cfg, arch, source))


def _shape(cfg: dict, source: str, head_dim: int | None) -> dict:
    """ModelConfig's sizes: each a positive integer, those a config may leave out as transformers
    derives them (num_key_value_heads, max_position_embeddings, head_dim: `head_dim` where the
    family's config class has a default, else hidden_size / heads)."""
    def need(name, default=None):
        """The config's, or `default` where it has none (null or absent)."""
        value = default if cfg.get(name) is None else cfg[name]
        if value is None:
            raise ConfigError(f"{source}: missing required field {name!r}")
        return positive_int(value, name, source)

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    kv_heads = need("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return dict(vocab_size=need("vocab_size"), hidden_size=hidden, intermediate_size=need("intermediate_size"),
                num_hidden_layers=need("num_hidden_layers"), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=need("head_dim", head_dim or hidden // heads),
                max_position_embeddings=need("max_position_embeddings", 2048))


def _mapping(cfg: dict, name: str, source: str) -> dict:
    """A JSON object, or {} where it is null or absent."""
    value = cfg.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} must be an object or null, got {value!r}")
    return value


def _activation(cfg: dict, source: str, ungated: bool) -> str:
    """The MLP's activation: a gate's, or an `ungated` family's."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("relu2" if ungated else "silu")
    known = UNGATED_ACTIVATIONS if ungated else ACTIVATIONS
    if act not in known:
        raise ConfigError(f"{source}: hidden activation {act!r} is not supported; supported: {', '.join(known)}")
    return act


def _rotary_dim(cfg: dict, rope: dict, head_dim: int, source: str, default: float, dims: int | None) -> int:
    """The leading dims of each head the rotary embedding turns (partial_rotary_factor of them, or
    `dims`, a hub MiniMax-M2's rotary_dim; `default` where the config names neither: transformers'
    GLM-4.5 turns half)."""
    named = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if named is None and isinstance(dims, (int, float)) and not isinstance(dims, bool):
        named = dims / head_dim
    partial = float(named or default)
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary_dim} rotary dims of a "
                          f"{head_dim}-dim head; they must be even and at least 2")
    return rotary_dim


def _parse_window(cfg: dict, arch: str, source: str, layers: int, family: dict) -> dict:
    """ModelConfig's sliding_window and sliding_layers: a Qwen or SmolLM3 has a window only with
    use_sliding_window, an OLMo 3, EXAONE 4 or Cohere 2 one of 4096 where its config names none;
    the layers with it are as config.json's layer_types says (transformers 5 writes it), else as
    transformers derives them: a Qwen's from max_window_layers on, Gemma 2's even ones, as
    sliding_window_pattern says (its default: Gemma 3's 6, the others' 4) Gemma 3's, OLMo 3's,
    EXAONE 4's and Cohere 2's, SmolLM3's those without a rotary embedding, every layer of the
    others (Mistral, Mixtral)."""
    gated = arch in QWEN_ARCHITECTURES or arch == SMOLLM3
    window = cfg.get("sliding_window", 4096 if arch in WINDOWED else None)
    if window is None or (gated and not cfg.get("use_sliding_window")):
        return {}
    return dict(sliding_window=positive_int(window, "sliding_window", source),
                sliding_layers=_sliding_layers(cfg, arch, source, layers, family))


def _sliding_layers(cfg: dict, arch: str, source: str, layers: int, family: dict) -> tuple[int, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
            raise ConfigError(f"{source}: layer_types must list {layers} of {' / '.join(kinds)}, got {types!r}")
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if arch == "Gemma2ForCausalLM":
        return tuple(range(0, layers, 2))
    if arch in PATTERN_DEFAULTS:
        pattern = cfg.get("sliding_window_pattern")  # null: the default, as transformers reads it
        return _pattern_sliding(PATTERN_DEFAULTS[arch] if pattern is None else pattern, source, layers)
    if arch == SMOLLM3:
        return family["nope_layers"]
    first = int(cfg.get("max_window_layers", 28)) if arch in QWEN_ARCHITECTURES else 0  # transformers' Qwen default
    return tuple(range(first, layers))


def _pattern_sliding(pattern, source: str, layers: int) -> tuple[int, ...]:
    """The windowed layers a sliding_window_pattern names: n (every n-th layer full, the others
    windowed) or EXAONE 4's string of L (windowed) and G (full) repeated from layer 0, the last
    layer full."""
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return tuple(i for i in range(layers - 1) if pattern[i % len(pattern)] == "L")
    raise ConfigError(f"{source}: sliding_window_pattern must be a positive integer or a string of L and G, "
                      f"got {pattern!r}")


_ROPE_FIELDS = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
                "original_max_position_embeddings": int, "beta_fast": float, "beta_slow": float, "truncate": bool,
                "attention_factor": float, "mscale": float, "mscale_all_dim": float}


def _parse_rope_scaling(raw: dict | None, source: str, max_positions: int, top_level_trained: int | None,
                        pairs: int) -> RopeScaling:
    """As transformers reads it: the context the model was trained for is the config's top-level
    original_max_position_embeddings (Phi-3 has one), else the scaling's own, else
    max_position_embeddings; a yarn or longrope config without a factor stretches it to
    max_position_embeddings. `pairs`: the rotary frequency pairs (longrope has a factor for each)."""
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    known = {}
    for name, cast in _ROPE_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) is not (cast is bool) or not isinstance(value, (int, float)) \
                or not -math.inf < value < math.inf:
            raise ConfigError(f"{source}: rope_scaling {name}={value!r} is not a finite {cast.__name__}")
        if name in ("factor", "original_max_position_embeddings") and value <= 0:
            raise ConfigError(f"{source}: rope_scaling {name} must be positive, got {value!r}")
        known[name] = cast(value)
    if top_level_trained is not None:
        known["original_max_position_embeddings"] = positive_int(top_level_trained, "original_max_position_embeddings",
                                                                 source)
    known.setdefault("original_max_position_embeddings", max_positions)
    if kind in ("yarn", "longrope") and "factor" not in known:
        known["factor"] = max_positions / known["original_max_position_embeddings"]
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            values = raw.get(name)
            if not isinstance(values, list) or len(values) != pairs or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
                raise ConfigError(f"{source}: rope_scaling {name} must be a list of {pairs} positive numbers "
                                  f"(one per rotary frequency pair), got {values!r}")
            known[name] = tuple(float(v) for v in values)
    return RopeScaling(rope_type=kind, **known)


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
