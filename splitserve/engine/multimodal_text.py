"""Multimodal checkpoints served text-only: which wrappers, which language model each holds (by its
text_config's model_type), where that model's tensors are, and the text_config as a config of its
own over transformers' defaults (a hub config.json lists only the values that differ from them)."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.config_error import ConfigError


@dataclass(frozen=True)
class Wrapper:
    text_models: dict[str, str]  # text_config's model_type -> the language model's architecture
    default_type: str            # the model_type of a text_config that names none
    weights_prefix: str          # what the language model's tensor names start with
    skipped: tuple[str, ...]     # the prefixes of the tensors not served (the vision tower, the projector)


_VISION = ("vision_tower.", "multi_modal_projector.")
WRAPPERS = {
    "Gemma3ForConditionalGeneration": Wrapper({"gemma3_text": "Gemma3ForCausalLM"}, "gemma3_text", "language_model.",
                                              _VISION),
    "Mistral3ForConditionalGeneration": Wrapper({"mistral": "MistralForCausalLM",
                                                 "ministral3": "Ministral3ForCausalLM"}, "mistral", "language_model.",
                                                _VISION),
}
# transformers' text config defaults, per language model
TEXT_DEFAULTS = {
    "Gemma3ForCausalLM": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                          "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                          "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                          "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "tie_word_embeddings": True},
    "MistralForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                           "rope_theta": 10000.0, "tie_word_embeddings": False},
    "Ministral3ForCausalLM": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
                              "num_hidden_layers": 34, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
                              "tie_word_embeddings": False,
                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                                  "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                  "llama_4_scaling_beta": 0.1}},
}


def text_config(cfg: dict, wrapper: Wrapper, source: str) -> dict:
    """The wrapper's text model as a config of its own: its text_config over transformers'
    defaults, with the wrapper's dtype and (where the text_config has none) token ids; the
    wrapper's tie_word_embeddings where it has one (transformers 5 ties by it)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: missing required field 'text_config'")
    kind = text.get("model_type", wrapper.default_type)
    if kind not in wrapper.text_models:
        raise ConfigError(f"{source}: text_config model_type {kind!r} is not supported; supported: "
                          f"{', '.join(wrapper.text_models)}")
    arch = wrapper.text_models[kind]
    merged = {**TEXT_DEFAULTS[arch], **text, "architectures": [arch]}
    for name in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config"):
        if name in cfg and name not in text:
            merged[name] = cfg[name]
    if "tie_word_embeddings" in cfg:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged
