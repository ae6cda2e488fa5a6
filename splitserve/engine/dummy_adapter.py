"""Random LoRA adapters in PEFT's on-disk format (adapter_config.json, adapter_model.safetensors,
tensors named as PEFT names them) for a model known by its config alone (the demo model, a shape
checkpoint), for benchmarks and tests, as dummy weights are for models. The engine's reading of the
format is checked against files PEFT itself saved (tests/engine/test_lora.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.engine.config import ModelConfig


def projection_shapes(c: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """PEFT target name -> (its module, out features, in features) in a dense Llama layer."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, w = c.hidden_size, c.intermediate_size
    return {"q_proj": ("self_attn", q, h), "k_proj": ("self_attn", kv, h), "v_proj": ("self_attn", kv, h),
            "o_proj": ("self_attn", h, q), "gate_proj": ("mlp", w, h), "up_proj": ("mlp", w, h),
            "down_proj": ("mlp", h, w)}


def write_adapter(path: str | Path, config: ModelConfig, targets: list[str], rank: int, seed: int,
                  std: float = 0.05) -> str:
    """A random adapter of `targets` in every layer, lora_alpha = 2 * rank; its directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(config), {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            module, out, inp = shapes[target]
            name = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
        "use_dora": False, "use_rslora": False, "modules_to_save": None, "fan_in_fan_out": False}))
    return str(path)
