"""A sparse mixture-of-experts model's fields of ModelConfig, read from its config.json as
transformers reads them."""
from __future__ import annotations

from splitserve.engine.config_error import ConfigError, positive_float, positive_int, positive_number

GLM4_MOE, ERNIE45_MOE, MINIMAX_M2 = "Glm4MoeForCausalLM", "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM"


def parse_moe(cfg: dict, arch: str, source: str, layers: int) -> dict:
    """ModelConfig's MoE fields as transformers reads them: Mixtral's and GPT-OSS's experts are
    intermediate_size wide, every layer is sparse and the top-k weights are always renormalized
    (GPT-OSS's clamp their SwiGLU: swiglu_limit, swiglu_alpha); Qwen2-MoE's and
    Qwen3-MoE's are moe_intermediate_size wide, and a layer is dense when listed in mlp_only_layers
    or off the decoder_sparse_step; Qwen2-MoE's sparse layers also have a shared expert. GLM-4.5's
    (`_glm4_moe`), Ernie 4.5's (`_ernie45_moe`) and MiniMax-M2's choose by a biased score: MiniMax's
    by sigmoid, its experts intermediate_size wide, every layer sparse, renormalized."""
    experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                    if cfg.get(k) is not None), None)
    top_k = cfg.get("num_experts_per_tok", cfg.get("moe_k"))
    positive_int(experts, "num_experts", source)
    positive_int(top_k, "num_experts_per_tok", source)
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={experts}")
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]))
    if arch == MINIMAX_M2:  # its multi-token-prediction modules, where the hub config has them, after the decoder's
        mtp = cfg.get("num_mtp_modules", 0) if cfg.get("use_mtp") else 0
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    moe_choice_bias="sigmoid", skipped_layers=positive_int(mtp, "num_mtp_modules", source, least=0))
    if arch == "GptOssForCausalLM":  # softmax over the top k router logits: the renormalized top k of the softmax
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    swiglu_limit=positive_number(cfg, "swiglu_limit", 7.0, source),
                    swiglu_alpha=positive_float(cfg, "swiglu_alpha", 1.702, source))
    width = positive_int(cfg.get("moe_intermediate_size"), "moe_intermediate_size", source)
    if arch == GLM4_MOE:
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    **_glm4_moe(cfg, source, layers, experts, top_k, width))
    if arch == ERNIE45_MOE:
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    **_ernie45_moe(cfg, source, layers, width))
    step = positive_int(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", source)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = positive_int(cfg.get("shared_expert_intermediate_size"), "shared_expert_intermediate_size", source,
                           least=0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                shared_expert_intermediate_size=shared)


def _glm4_moe(cfg: dict, source: str, layers: int, experts: int, top_k: int, width: int) -> dict:
    """GLM-4.5's: the first first_k_dense_replace layers dense; n_shared_experts ungated experts
    beside the routed ones; each token's experts the top k of sigmoid(logits) + a learned bias among
    the topk_group best of n_group groups (a group's score: the sum of its two best), weighted by
    their sigmoid alone, renormalized (norm_topk_prob) and times routed_scaling_factor;
    num_nextn_predict_layers stored after the decoder's layers."""
    groups, best = (positive_int(cfg.get(name, 1), name, source) for name in ("n_group", "topk_group"))
    if experts % groups or best > groups:
        raise ConfigError(f"{source}: n_group={groups} must divide n_routed_experts={experts} and be at least "
                          f"topk_group={best}")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(f"{source}: n_group={groups} leaves groups of fewer than 2 experts (a group scores its "
                          "two best)")
    if best * (experts // groups) < top_k:
        raise ConfigError(f"{source}: topk_group={best} groups hold fewer experts than num_experts_per_tok")
    dense = positive_int(cfg.get("first_k_dense_replace", 1), "first_k_dense_replace", source, least=0)
    shared = positive_int(cfg.get("n_shared_experts", 1), "n_shared_experts", source, least=0)
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0))
    return dict(norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), dense_layers=tuple(range(min(dense, layers))),
                shared_expert_intermediate_size=width * shared, moe_choice_bias="sigmoid", moe_groups=(groups, best),
                routed_scaling_factor=positive_float(cfg, "routed_scaling_factor", 1.0, source),
                skipped_layers=positive_int(mtp, "num_nextn_predict_layers", source, least=0))


def _ernie45_moe(cfg: dict, source: str, layers: int, width: int) -> dict:
    """Ernie 4.5's: a layer sparse where (layer + 1) is a multiple of moe_layer_interval between
    moe_layer_start_index and moe_layer_end_index (-1: the last), dense elsewhere; each token's
    experts the top k of softmax(logits) + a learned bias, weighted by their softmax alone,
    renormalized; moe_num_shared_experts ungated experts beside them; its multi-token-prediction
    tensors (`model.mtp_*`) not served."""
    start = positive_int(cfg.get("moe_layer_start_index", 1), "moe_layer_start_index", source, least=0)
    end = cfg.get("moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else positive_int(end, "moe_layer_end_index", source, least=0)
    every = positive_int(cfg.get("moe_layer_interval", 1), "moe_layer_interval", source)
    shared = positive_int(cfg.get("moe_num_shared_experts", 2), "moe_num_shared_experts", source, least=0)
    return dict(norm_topk_prob=True, moe_choice_bias="softmax", shared_expert_intermediate_size=width * shared,
                dense_layers=tuple(i for i in range(layers) if not (start <= i <= end and (i + 1) % every == 0)),
                skipped_weights=("model.mtp_",))
