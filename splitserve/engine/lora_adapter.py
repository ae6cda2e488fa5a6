"""LoRA adapters as PEFT saves them: a directory with `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`), read into per-projection (A, B) pairs.

An adapter adds `scale * B @ A @ x` to a projection's output, `scale` being `lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA); it is folded into B here, so a step adds `B @ (A @ x)`.
What this engine adapts: the decoder's dense projections (attention's q, k, v and o; a dense MLP's
gate, up and down), named as the base checkpoint names them. An adapter that needs more (DoRA,
trained biases, modules_to_save, embeddings or the LM head, per-module rank or alpha patterns, an
MoE layer's experts) is a ConfigError naming what it asks for: ignoring it would serve other
weights than the ones trained.

An adapter's identity names what its KV is computed under (its prefix-cache blocks chain from it):
its name for one loaded at start, as the ingress names it too; for one loaded at run time, its
name and a digest of its files, so the same name loaded again with other weights never meets the
blocks of the old ones.
"""
from __future__ import annotations

import hashlib
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
    identity: str


@dataclass(frozen=True)
class RunTimeLimits:
    """What an adapter loaded at run time may be: its rank at most the slots', its weights file at
    most `max_bytes`."""

    max_rank: int
    max_bytes: int


def load_adapter(name: str, path: str | Path, limits: RunTimeLimits | None = None) -> LoraAdapter:
    """Read the adapter at `path`; `limits` for one named in a load request at run time (not in
    lora_modules): its rank and file size are bounded before its weights are read. A missing,
    malformed or unsupported one raises ConfigError naming the adapter and what is wrong."""
    root, where = Path(path), "lora_path" if limits else "lora_modules"
    try:
        return _read(name, root, limits)
    except CheckpointError as error:
        raise ConfigError(f"{where}: adapter {name!r}: {error}") from None
    except OSError as error:  # a directory this process may not read, say
        raise ConfigError(f"{where}: adapter {name!r}: {root}: {error.strerror or error}") from None
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _read(name: str, root: Path, limits: RunTimeLimits | None) -> LoraAdapter:
    config = read_json(root / CONFIG_FILE)
    rank, alpha = _checked_config(name, config)
    if limits is not None and rank > limits.max_rank:
        raise ConfigError(f"adapter {name!r} has rank {rank}, past max_lora_rank {limits.max_rank}")
    weights_file = find_weights_file(root)
    if limits is not None and weights_file.stat().st_size > limits.max_bytes:
        raise ConfigError(f"adapter {name!r}: {weights_file} holds {weights_file.stat().st_size} bytes, more than a "
                          f"rank-{limits.max_rank} adapter of every projection of this model ({limits.max_bytes})")
    weights = _pairs(name, rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank),
                     _read_weights(weights_file))
    if not weights:
        raise ConfigError(f"adapter {name!r} at {root} has no LoRA weights")
    identity = name if limits is None else f"{name}\0{_digest(root / CONFIG_FILE, weights_file)}"
    return LoraAdapter(name, rank, weights, identity)


def _pairs(name: str, rank: int, scale: float, tensors: dict[str, torch.Tensor]
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The file's tensors as (A, B * scale) per adapted module, in float32."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _TENSOR.fullmatch(key)
        if found is None:
            raise ConfigError(f"adapter {name!r} holds {key!r}, which is not a LoRA A or B weight "
                              "of a projection (only those are served)")
        halves.setdefault(found["module"], {})[found["half"]] = tensor
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"adapter {name!r} has lora_{''.join(pair)} of {module} without the other")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ConfigError(f"adapter {name!r}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} "
                              f"are not [r, in] and [out, r] with r={rank}")
        weights[module] = (a, b * scale)
    return weights


def _checked_config(name: str, config: dict) -> tuple[int, float]:
    """(r, lora_alpha), once the config asks for nothing this engine does not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"adapter {name!r} is a {config['peft_type']} adapter; only LoRA is served")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key)
        if value is not None and value != default and value not in ({}, []):
            raise ConfigError(f"adapter {name!r} sets {key}={config[key]!r}, which this engine does "
                              f"not serve (only {default!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK:
        raise ConfigError(f"adapter {name!r}: r must be an integer in [1, {MAX_LORA_RANK}], "
                          f"got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ConfigError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _digest(*files: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def find_weights_file(root: Path) -> Path:
    for file in (root / f for f in WEIGHT_FILES):
        if file.is_file():
            return file
    raise CheckpointError(f"{root}: no {' or '.join(WEIGHT_FILES)}")


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors and torch raise their own types for a corrupt file
        raise CheckpointError(f"{file}: not a readable weights file ({error})") from error
