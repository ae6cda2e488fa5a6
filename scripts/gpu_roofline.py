"""What a decode or prefill step of a model reads and computes, and the device peaks it is measured
against (bench_gpu.py's MBU and MFU). `c` is a config.json dict: dense or sparse (MoE) layers,
sliding windows, MXFP4 experts (17/32 of a byte a weight: half a byte and a scale byte per 32),
FP8 projections and experts (a byte a weight and its share of its block's float32 scale, as a GPU
whose Triton reads e4m3 keeps them)."""
from __future__ import annotations

from splitserve.engine.config import ModelConfig

PEAKS = [  # (name contains, HBM bytes/s, dense bf16 FLOP/s); the first match wins
    ("H200", 4.8e12, 989e12), ("H100 NVL", 3.9e12, 835e12), ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12), ("A100-SXM4-80GB", 2.039e12, 312e12), ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12), ("L40S", 0.864e12, 362e12)]
MXFP4_BYTES = 17 / 32  # a weight's share of its byte pair (two codes) and its group's scale byte


def peaks(name: str, hbm_tbs: float | None, tflops: float | None) -> tuple[float | None, float | None]:
    hbm, flops = next(((h, f) for key, h, f in PEAKS if key in name), (None, None))
    return (hbm_tbs * 1e12 if hbm_tbs else hbm), (tflops * 1e12 if tflops else flops)


def experts_hit(c: dict, tokens: int) -> float:
    """Experts a sparse layer reads for `tokens` tokens routed uniformly at random (the expectation:
    each expert is missed by a token's top k with probability 1 - k / experts)."""
    m = ModelConfig.from_hf(c)
    return m.num_experts * (1 - (1 - m.num_experts_per_tok / m.num_experts) ** tokens)


def matrix_bytes(m: ModelConfig, element: int) -> float:
    """Bytes a projection's weight takes per value: FP8's (a code and its share of its block's
    scale; scales of a row or a tensor, under 0.1%, not counted), else `element`."""
    if m.quantization != "fp8":
        return element
    return 1 + 4 / (m.weight_block_size[0] * m.weight_block_size[1]) if m.weight_block_size else 1


def _attention_params(m: ModelConfig) -> tuple[int, int]:
    """(its projections' matrix weights, its other parameters: biases, sinks, Q and K norms)."""
    heads, kv, d = m.num_attention_heads, m.num_key_value_heads, m.head_dim
    matrices = m.hidden_size * (heads + 2 * kv) * d + heads * d * m.hidden_size
    others = (heads + 2 * kv) * d * m.attention_bias + m.hidden_size * m.attention_out_bias
    return matrices, others + heads * m.attention_sinks + 2 * d * m.qk_norm


def _norms(m: ModelConfig) -> int:
    return (4 if m.gemma_norms else 2) * m.hidden_size  # Gemma's layers norm each block's input and output


def _expert_params(m: ModelConfig) -> tuple[int, int]:
    """(an expert's matrix weights, its biases)."""
    width = m.moe_intermediate_size
    return 3 * m.hidden_size * width, (2 * width + m.hidden_size) * (m.architecture == "GptOssForCausalLM")


def _sparse_fixed_params(m: ModelConfig) -> tuple[int, int]:
    """A sparse layer's parameters every token reads: (Qwen2-MoE's shared expert's matrices, the
    router (with GPT-OSS's bias) and the shared expert's gate)."""
    router = m.num_experts * m.hidden_size + m.num_experts * (m.architecture == "GptOssForCausalLM")
    shared = m.shared_expert_intermediate_size
    return 3 * m.hidden_size * shared, router + (m.hidden_size if shared else 0)


def weight_bytes(c: dict, element: int, experts: float | None = None) -> float:
    """Bytes of every layer's weights (a sparse layer's `experts` of them; None: all), the final
    norm and the LM head, in `element`-byte values (MXFP4 experts at MXFP4_BYTES, FP8 blocks'
    projections and experts at `matrix_bytes`)."""
    m = ModelConfig.from_hf(c)
    matrix, biases = _expert_params(m)
    projection = matrix_bytes(m, element)
    expert = matrix * (MXFP4_BYTES if m.quantization == "mxfp4" else projection) + biases * element
    attention = _attention_params(m)
    total = 0.0
    for layer in range(m.num_hidden_layers):
        total += attention[0] * projection + (attention[1] + _norms(m)) * element
        if m.is_moe_layer(layer):
            shared, others = _sparse_fixed_params(m)
            total += shared * projection + others * element + (m.num_experts if experts is None else experts) * expert
        else:
            total += 3 * m.hidden_size * m.intermediate_size * projection
    return total + (m.hidden_size + m.vocab_size * m.hidden_size) * element


def decode_weight_bytes(c: dict, batch: int, element: int) -> float:
    """A decode step of `batch` sequences: the weights (of the experts `batch` tokens hit, as
    `experts_hit` expects) and the embedding's `batch` rows."""
    sparse = ModelConfig.from_hf(c).num_experts > 0
    return weight_bytes(c, element, experts_hit(c, batch) if sparse else None) + batch * c["hidden_size"] * element


def decode_kv_bytes(c: dict, batch: int, context: float, element: int) -> float:
    """K and V a decode step of `batch` sequences of `context` tokens reads: a windowed layer the
    last `sliding_window` of them."""
    m = ModelConfig.from_hf(c)
    per_token = 2 * m.num_key_value_heads * m.head_dim * element
    return batch * per_token * sum(min(context, m.window_of(layer) or context) for layer in range(m.num_hidden_layers))


def prefill_flops(c: dict, n: int) -> float:
    """Model FLOPs of an n-token prefill: 2 per token and weight it multiplies by (a sparse layer's
    top-k experts), the LM head on the one sampled row, and attention, QK^T and PV each 2 N^2 d per
    head halved as causal (a windowed layer's queries see at most the window: N w - w^2 / 2 pairs)."""
    m = ModelConfig.from_hf(c)
    total = 0.0
    for layer in range(m.num_hidden_layers):
        if m.is_moe_layer(layer):
            mlp = sum(_sparse_fixed_params(m)) + m.num_experts_per_tok * _expert_params(m)[0]
        else:
            mlp = 3 * m.hidden_size * m.intermediate_size
        window = m.window_of(layer)
        pairs = n * n / 2 if window is None or window >= n else n * window - window * window / 2
        total += 2 * n * (sum(_attention_params(m)) + _norms(m) + mlp) + 4 * pairs * m.num_attention_heads * m.head_dim
    return total + 2 * m.vocab_size * m.hidden_size


def throughput_floor_s(c: dict, prompts: int, prompt: int, output: int, element: int, hbm: float | None,
                       flops: float | None) -> float | None:
    """The least time `prompts` prompts of `prompt` tokens, each then decoding to `output` tokens,
    take when they are prefilled, then decoded together (as a static batch runs them), each phase
    at its roofline: the prefills' FLOPs at the compute peak, then `output - 1` decode steps (the
    prefill samples the first token), each reading the weights and every sequence's KV, at the HBM
    peak. None without the peaks."""
    if not hbm or not flops:
        return None
    decode = sum(decode_weight_bytes(c, prompts, element) + decode_kv_bytes(c, prompts, prompt + step, element)
                 for step in range(1, output))
    return prompts * prefill_flops(c, prompt) / flops + decode / hbm

