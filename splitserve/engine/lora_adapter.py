"""LoRA adapters as PEFT saves them: a directory with `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`), read into per-projection (A, B) pairs.

An adapter adds `scale * B @ A @ x` to a projection's output, `scale` being `lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA); it is folded into B here, so a step adds `B @ (A @ x)`.
What this engine adapts: the decoder's dense projections (attention's q, k, v and o; a dense MLP's
gate, up and down), named as the base checkpoint names them. An adapter that needs more (DoRA,
trained biases, modules_to_save, embeddings or the LM head, per-module rank or alpha patterns, an
MoE layer's experts) is a ConfigError naming what it asks for: ignoring it would serve other
weights than the ones trained.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitserve.engine.config import ConfigError
from splitserve.engine.loader import CheckpointError, read_json

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_LORA_RANK = 512
_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight")
# settings whose non-default values change what the adapter computes, and those defaults
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                "fan_in_fan_out": False, "lora_bias": False}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: per adapted projection (its checkpoint name, `model.layers.0.self_attn.q_proj`),
    A [r, in] and B [out, r] with the scale folded in, in float32."""

    name: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: str | Path) -> LoraAdapter:
    """Read the adapter at `path`; a missing, malformed or unsupported one raises ConfigError naming
    the adapter and what is wrong."""
    root = Path(path)
    try:
        config = read_json(root / CONFIG_FILE)
        tensors = _read_weights(root)
    except CheckpointError as error:
        raise ConfigError(f"lora_modules: adapter {name!r}: {error}") from None
    rank, alpha = _checked_config(name, config)
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _TENSOR.fullmatch(key)
        if found is None:
            raise ConfigError(f"lora_modules: adapter {name!r} holds {key!r}, which is not a LoRA A or B weight "
                              "of a projection (only those are served)")
        halves.setdefault(found["module"], {})[found["half"]] = tensor
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"lora_modules: adapter {name!r} has lora_{''.join(pair)} of {module} without the other")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ConfigError(f"lora_modules: adapter {name!r}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} "
                              f"are not [r, in] and [out, r] with r={rank}")
        weights[module] = (a, b * scale)
    if not weights:
        raise ConfigError(f"lora_modules: adapter {name!r} at {root} has no LoRA weights")
    return LoraAdapter(name, rank, weights)


def _checked_config(name: str, config: dict) -> tuple[int, float]:
    """(r, lora_alpha), once the config asks for nothing this engine does not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"lora_modules: adapter {name!r} is a {config['peft_type']} adapter; only LoRA is served")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key)
        if value is not None and value != default and value not in ({}, []):
            raise ConfigError(f"lora_modules: adapter {name!r} sets {key}={config[key]!r}, which this engine does "
                              f"not serve (only {default!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK:
        raise ConfigError(f"lora_modules: adapter {name!r}: r must be an integer in [1, {MAX_LORA_RANK}], "
                          f"got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ConfigError(f"lora_modules: adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    for file in (root / f for f in WEIGHT_FILES):
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # safetensors and torch raise their own types for a corrupt file
            raise CheckpointError(f"{file}: not a readable weights file ({error})") from error
    raise CheckpointError(f"{root}: no {' or '.join(WEIGHT_FILES)}")
