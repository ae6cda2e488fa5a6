"""Model shapes with no weights: `config.json` contents for `write_shape_checkpoint` and
load_format="dummy", so the GPU benchmark and the GPU tests run real shapes without a download."""
from __future__ import annotations

# Llama-3-8B's layers with Llama-3.1's 128k context (no rope scaling: with random weights it changes
# nothing measured); an 8k prompt needs max_model_len > 8192, past Llama-3's own context
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}
