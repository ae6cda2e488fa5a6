"""The built-in `demo` model: a small Llama over the byte tokenizer, with seeded dummy weights.

It needs no download, so the server, tests and benchmarks can run anywhere; its output is noise.
"""
from __future__ import annotations

from splitserve.engine.config import ModelConfig
from splitserve.engine.tokenizer import ByteTokenizer

DEMO_SEED = 0

DEMO_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
}


def demo_model_config() -> ModelConfig:
    return ModelConfig.from_hf(DEMO_MODEL_CONFIG, source="splitserve.engine.demo.DEMO_MODEL_CONFIG")


def demo_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()
