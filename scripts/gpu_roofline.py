"""What a decode or prefill step of a Llama-shaped model reads and computes, and the device peaks
it is measured against (bench_gpu.py's MBU and MFU). `c` is a config.json dict."""
from __future__ import annotations

PEAKS = [  # (name contains, HBM bytes/s, dense bf16 FLOP/s); the first match wins
    ("H200", 4.8e12, 989e12), ("H100 NVL", 3.9e12, 835e12), ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12), ("A100-SXM4-80GB", 2.039e12, 312e12), ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12), ("L40S", 0.864e12, 362e12)]


def peaks(name: str, hbm_tbs: float | None, tflops: float | None) -> tuple[float | None, float | None]:
    hbm, flops = next(((h, f) for key, h, f in PEAKS if key in name), (None, None))
    return (hbm_tbs * 1e12 if hbm_tbs else hbm), (tflops * 1e12 if tflops else flops)


def layer_params(c: dict) -> int:
    head = c["hidden_size"] // c["num_attention_heads"]
    qkv = c["hidden_size"] * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head
    out = c["num_attention_heads"] * head * c["hidden_size"]
    mlp = 3 * c["hidden_size"] * c["intermediate_size"]
    return qkv + out + mlp + 2 * c["hidden_size"]


def decode_weight_bytes(c: dict, batch: int, element: int) -> int:
    lm_head = c["vocab_size"] * c["hidden_size"]
    read = c["num_hidden_layers"] * layer_params(c) + c["hidden_size"] + lm_head + batch * c["hidden_size"]
    return read * element


def prefill_flops(c: dict, n: int) -> float:
    head = c["hidden_size"] // c["num_attention_heads"]
    attention = 2 * n * n * c["num_attention_heads"] * head  # QK^T and PV, each 2 N^2 d per head, halved: causal
    return c["num_hidden_layers"] * (2 * n * layer_params(c) + attention) + 2 * c["vocab_size"] * c["hidden_size"]
