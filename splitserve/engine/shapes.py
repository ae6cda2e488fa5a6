"""Model shapes with no weights: `config.json` contents for `write_shape_checkpoint` and
load_format="dummy", so the GPU benchmark, the GPU tests and the kernel compile check run real
shapes without a download."""
from __future__ import annotations

# Llama-3-8B's layers with Llama-3.1's 128k context (no rope scaling: with random weights it changes
# nothing measured); an 8k prompt needs max_model_len > 8192, past Llama-3's own context
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}
# Qwen3-8B's layers (Q and K normed per head), and its FP8 release: every attention and MLP projection in
# float8 e4m3 with a scale per 128x128 block, kept so on a GPU whose Triton reads e4m3 (a byte a weight)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
QWEN3_8B_FP8 = {**QWEN3_8B, "quantization_config": FP8_BLOCKS}
# its FP8-dynamic release (llm-compressor's compressed-tensors): FP8 projections with one scale a row, kept so on a
# GPU whose Triton reads e4m3 (its dynamic per-token activation scales unused: activations stay bf16)
LLAMA3_8B_FP8_DYNAMIC = {**LLAMA3_8B, "quantization_config": {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}}}}
# llm-compressor's W4A16 (pack-quantized, as RedHatAI publishes them): 4-bit weights in groups of 128 columns with
# zero points; Llama-3-8B's release, its projections kept packed on a GPU (the integer GEMM, `model/int_linear.py`)
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False,
             "dynamic": False}, "input_activations": None}}}
LLAMA3_8B_W4A16 = {**LLAMA3_8B, "quantization_config": W4A16}
# sparse MoE: 128 experts 768 wide, top 8 renormalized, every layer sparse
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
# its FP8 release: block-wise FP8 weights, kept FP8 (experts and projections) on a GPU whose Triton reads e4m3
QWEN3_30B_A3B_FP8 = {**QWEN3_30B_A3B, "quantization_config": FP8_BLOCKS}
# its W4A16: experts kept packed (the fused-MoE kernels, 14.4 GiB of them against bf16's 54), projections on a GPU
QWEN3_30B_A3B_W4A16 = {**QWEN3_30B_A3B, "quantization_config": W4A16}
# sparse MoE: 8 experts 14336 wide, top 2
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
# four norms a layer, soft-capped scores and logits, a 4k window on every other layer
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584,
             "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
             "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
             "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1}
# sparse MoE: 32 biased experts 2880 wide with the clamped SwiGLU, top 4, in MXFP4 (kept packed); attention
# sinks, a 128-token window on every other layer, YaRN to 128k
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
               "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "attention_bias": True, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
               "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "eos_token_id": 200002, "pad_token_id": 199999,
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
# the 20B's layers, 36 of them with 128 experts each (its 61 GB of MXFP4 experts fit one 80 GB GPU packed)
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-8b-fp8-dynamic": LLAMA3_8B_FP8_DYNAMIC, "llama3-8b-w4a16": LLAMA3_8B_W4A16,
          "qwen3-8b": QWEN3_8B,
          "qwen3-8b-fp8": QWEN3_8B_FP8, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-30b-a3b-fp8": QWEN3_30B_A3B_FP8,
          "qwen3-30b-a3b-w4a16": QWEN3_30B_A3B_W4A16,
          "mixtral-8x7b": MIXTRAL_8X7B, "gemma2-9b": GEMMA2_9B, "gpt-oss-20b": GPT_OSS_20B,
          "gpt-oss-120b": GPT_OSS_120B}
