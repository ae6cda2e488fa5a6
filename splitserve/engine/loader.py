"""Checkpoint loading: a Hugging Face model directory (config.json + safetensors) into a model.

The checkpoint's tensors load by the Hugging Face names `checkpoint_tensors` gives the model's
weights (a merged projection's parts are slices of it). A checkpoint that stores a merged
projection as one tensor (Phi-3's `qkv_proj`, `gate_up_proj`) is read as its parts, row ranges
of it. A tied `lm_head` is recognised because it is the same tensor as
`model.embed_tokens.weight`, so loading either name fills both. A tensor-parallel rank reads only
its part of each tensor from the file (`shard_slices`). An MXFP4 tensor (GPT-OSS's experts: its
`_blocks` and `_scales`, `mxfp4`) and an FP8 weight (its float8 `.weight` and `.weight_scale_inv`,
`fp8`) load as they are where the model keeps them so (MoE experts; on a GPU, dense projections);
otherwise each is dequantized whole on the parameter's device once both halves are read, then the
rank's part of it is kept. Packed integer weights (`.weight_packed`, `_scale`, `_shape`, and
`_zero_point` where asymmetric, `int_weights`) load as they are where the model keeps them so (on a
GPU, dense projections: `_shape` then only says what the parameters' shapes check), otherwise are
dequantized so once all their parts are read. An AutoAWQ checkpoint's tensors are read as those
(`awq.AwqHandle`: converted whole as read, a rank's part then taken of them).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from splitserve.engine import awq, fp8, int_weights, mxfp4
from splitserve.engine.config import FUSED_ARCHITECTURES, ModelConfig
from splitserve.engine.model.llama import checkpoint_tensors, shard_slices
from splitserve.engine.model.sharding import ShardSlice

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by the model, saved by old checkpoints


class CheckpointError(ValueError):
    """A checkpoint file is missing or wrong; the message names the file (and tensor or field)."""


def load_model_config(path: str | Path) -> ModelConfig:
    """Read `<path>/config.json`; `generation_config.json`'s `eos_token_id` overrides the config's."""
    cfg_file = _checkpoint_dir(path) / "config.json"
    cfg = read_json(cfg_file)
    gen_file = cfg_file.with_name("generation_config.json")
    if gen_file.is_file():
        eos = read_json(gen_file).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return ModelConfig.from_hf(cfg, source=str(cfg_file))


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of a single-file or sharded safetensors checkpoint."""
    for _, name, handle in _iter_with_files(path):
        yield name, handle.get_tensor(name)


def load_weights(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Copy the checkpoint at `path` into `model`'s parameters.

    `dtype`: when given, the model is converted to it first; each tensor is then cast to its
    parameter's dtype (and device) as it is copied. Every parameter must be loaded exactly by name
    and shape; anything else raises CheckpointError naming the tensor and the file.
    """
    if dtype is not None:
        model.to(dtype=dtype)
    targets, parts = dict(checkpoint_tensors(model)), shard_slices(model)
    absent = getattr(model, "absent_tensors", frozenset())  # held by another rank only
    config = model.config if isinstance(getattr(model, "config", None), ModelConfig) else None  # ours, not HF's
    loaded: set[tuple[int, tuple]] = set()  # (storage offset, shape): a tied weight counts once for both names
    packed: dict[str, dict[str, torch.Tensor]] = {}  # a quantized tensor's name -> its halves read so far
    ignored = IGNORED_SUFFIXES + (fp8.IGNORED_SUFFIXES if config is not None and config.quantization == "fp8" else ())
    with torch.no_grad():
        for file, name, handle in _iter_with_files(path, config is not None and config.int_layout == "awq"):
            ours = _model_name(file, name, config)
            if ours is not None and _load_kv_scale(model, ours, file, name, handle):
                continue
            if ours is None or ours.endswith(ignored) or _kept_int_shape(ours, targets, config):
                continue
            ours = _kept_scale_name(ours, targets, config)
            dequantized, half = None, _quantized_half(file, ours, handle, name, config, targets)
            if (half[0] if half else ours) in absent:
                continue
            if half is not None:
                ours, dequantized = _joined(file, *half, handle.get_tensor(name), packed, targets, config)
                if dequantized is None:
                    continue
            found = []  # (parameter, its part of the tensor as shard_slices says, that tensor's full shape)
            for part_name in _fused_parts(ours, config) or [ours]:
                target = targets.get(part_name)
                if target is None:
                    raise CheckpointError(f"{file}: tensor {name!r} has no matching parameter in {type(model).__name__}")
                part = parts.get(part_name)
                found.append((target, part, part.full_shape(target.shape) if part else tuple(target.shape)))
            shape = tuple(handle.get_slice(name).get_shape() if dequantized is None else dequantized.shape)
            whole = found[0][2] if len(found) == 1 else (  # fused parts are stacked by rows
                sum(full[0] for *_, full in found), *found[0][2][1:])
            if dequantized is None and _tensor_scale_for_rows(ours, shape, whole):  # kept one a row (fp8.ROWS)
                dequantized, shape = handle.get_tensor(name).reshape(1, 1).expand(whole), whole
            if shape != whole:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {shape}, the model expects {whole}")
            first_row = 0
            for target, part, full in found:
                if len(found) > 1:  # a fused tensor: the part's rows of it, or this rank's of them
                    start, stop = (part.start, part.stop) if part else (0, full[0])
                    part = ShardSlice(0, first_row + start, first_row + stop, whole[0])
                    first_row += full[0]
                if dequantized is None:
                    target.copy_(_read(handle, name, part))
                else:
                    target.copy_(part.take(dequantized) if part else dequantized)
                loaded.add(tensor_key(target))
    if packed:
        lacking = sorted(_other_half(base, halves, config) for base, halves in packed.items())
        raise CheckpointError(f"{_weights_file(path)}: quantized tensors lack their other half: {lacking}")
    missing = [name for name, target in targets.items() if tensor_key(target) not in loaded]
    if missing:
        raise CheckpointError(f"{_weights_file(path)}: checkpoint has no tensor for parameters {missing}")


FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


BACKBONE_NAMES = ("embed_tokens.", "layers.", "norm.")  # a base model's tensors, as its own checkpoint names them


def _model_name(file: Path, name: str, config: ModelConfig | None) -> str | None:
    """The model's name of a checkpoint tensor; None for one it does not serve (a multimodal
    checkpoint's vision tower, GLM-4.5's multi-token-prediction layers after the decoder's,
    Ernie 4.5's beside them). A checkpoint saved from the base model names the backbone's tensors
    without `model.` (Qwen3-Embedding's, whose tied LM head it does not hold)."""
    if config is not None and config.skipped_layers and name.startswith("model.layers."):
        layer, first = name.split(".")[2], config.num_hidden_layers
        if layer.isdigit() and first <= int(layer) < first + config.skipped_layers:
            return None
    if config is not None and name.startswith(config.skipped_weights):
        return None
    for theirs, ours in config.weight_renames if config is not None else ():
        name = name.replace(theirs, ours)
    if name.startswith(BACKBONE_NAMES):
        return f"model.{name}"
    if config is None or not config.weights_prefix:
        return name
    if not name.startswith(config.weights_prefix):
        raise CheckpointError(f"{file}: tensor {name!r} is neither the language model's "
                              f"({config.weights_prefix}...) nor skipped ({', '.join(config.skipped_weights)})")
    return name.removeprefix(config.weights_prefix)


def _load_kv_scale(model: nn.Module, ours: str, file: Path, name: str, handle) -> bool:
    """Whether `ours` is an attention layer's FP8 KV-cache scale (`<attn>.k_scale` / `.v_scale`
    as compressed-tensors and Quark save them, `<attn>.k_proj.k_scale` / `.v_proj.v_scale` as
    ModelOpt does), and if so sets it on that layer's `kv_scale`: one positive number."""
    base, _, leaf = ours.rpartition(".")
    if leaf not in ("k_scale", "v_scale"):
        return False
    try:
        attention = model.get_submodule(base.removesuffix(f".{leaf[0]}_proj"))
    except AttributeError:
        return False
    if not hasattr(attention, "kv_scale"):
        return False
    value = handle.get_tensor(name)
    if value.numel() != 1 or not 0 < value.float().item() < math.inf:
        raise CheckpointError(f"{file}: tensor {name!r} must be one positive, finite KV-cache scale, "
                              f"got shape {tuple(value.shape)}")
    scales = list(attention.kv_scale)
    scales[leaf == "v_scale"] = value.float().item()
    attention.kv_scale = tuple(scales)
    return True


def _fused_parts(name: str, config: ModelConfig | None) -> list[str] | None:
    """The names, in an unfused checkpoint, of a fused checkpoint tensor's parts (Phi-3's qkv_proj,
    gate_up_proj), in the order its rows stack them; None for any other tensor."""
    if config is None or config.architecture not in FUSED_ARCHITECTURES:
        return None
    owner, _, kind = name.rpartition(".")
    prefix, _, projection = owner.rpartition(".")
    return [f"{prefix}.{part}.{kind}" for part in FUSED_PARTS.get(projection, ())] or None


def _quantized_half(file: Path, name: str, handle, checkpoint_name: str, config: ModelConfig | None,
                    targets: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """(the tensor it is half of, which half) for half of a quantized tensor the model dequantizes:
    MXFP4's blocks or scales, FP8's float8 weight or its scales, where the model does not keep them
    so (its parameter in the codes' dtype, or the scales'); None for any other tensor. A float8
    parameter the checkpoint stores unquantized raises CheckpointError naming the tensor."""
    if name.endswith(mxfp4.SUFFIXES) and name not in targets:
        base, _, half = name.rpartition("_")
        return base, half
    if _int_scheme(config) is not None:
        return None if any(n in targets for n in _filled(name, config)) else int_weights.part_of(name)
    if config is None or config.quantization != "fp8":
        return None
    stored = handle.get_slice(checkpoint_name).get_dtype()
    kept = next((targets[n] for n in _filled(name, config) if n in targets), None)
    if kept is not None and kept.dtype == torch.float8_e4m3fn and not stored.startswith("F8"):
        raise CheckpointError(f"{file}: tensor {name!r} is stored as {stored}, not float8 as quantization_config "
                              "says (list its module in its modules_to_not_convert, or compressed-tensors' ignore)")
    if kept is not None and (kept.dtype == torch.float8_e4m3fn or name.endswith(fp8.SCALE_SUFFIXES)):
        return None
    suffix = _scale_suffix(name)
    if suffix is not None:
        return name.removesuffix(suffix), "scale"
    if stored.startswith("F8"):
        return name, "weight"
    return None


def _kept_int_shape(name: str, targets: dict[str, torch.Tensor], config: ModelConfig | None) -> bool:
    """Whether `name` is the `.weight_shape` of packed integers the model keeps as they are."""
    return (_int_scheme(config) is not None and name.endswith(".weight_shape")
            and any(n in targets for n in _filled(name.removesuffix("_shape") + "_packed", config)))


def _int_scheme(config: ModelConfig | None) -> int_weights.IntWeights | None:
    """A packed integer checkpoint's scheme; None for any other."""
    return None if config is None else config.int_weights


def _kept_scale_name(name: str, targets: dict[str, torch.Tensor], config: ModelConfig | None) -> str:
    """The model's name of FP8 scales it keeps (`<weight>_scale_inv`, a fused tensor's parts'),
    which a checkpoint may name `<weight>_scale` (AutoFP8's, compressed-tensors'); any other name
    as it is."""
    suffix = _scale_suffix(name)
    if suffix is None or name in targets:
        return name
    kept = name.removesuffix(suffix) + fp8.SCALE_SUFFIXES[0]
    return kept if any(n in targets for n in _filled(kept, config)) else name


def _scale_suffix(name: str) -> str | None:
    """Which of FP8's scale suffixes ends `name`, if one does."""
    return next((s for s in fp8.SCALE_SUFFIXES if name.endswith(s)), None)


def _filled(name: str, config: ModelConfig | None) -> list[str]:
    """The model's names a checkpoint tensor fills: its own, and a fused tensor's parts'."""
    return [name] + (_fused_parts(name, config) or [])


def _tensor_scale_for_rows(name: str, shape: tuple, whole: tuple) -> bool:
    """Whether `name` is an FP8 weight's one scale (AutoFP8's, compressed-tensors' tensor-wise)
    where the model keeps one a row ([rows, 1])."""
    return name.endswith(fp8.SCALE_SUFFIXES) and len(whole) == 2 and whole[1] == 1 and shape in ((), (1,), (1, 1))


def _other_half(base: str, halves: dict[str, torch.Tensor], config: ModelConfig | None) -> str:
    """The name of the half (the parts) a quantized tensor lacks."""
    if _int_scheme(config) is not None:
        suffixes = {part: suffix for suffix, part in int_weights.SUFFIXES.items()}
        return ", ".join(base + suffixes[part] for part in sorted(config.int_weights.parts() - halves.keys()))
    if "scale" in halves:
        return f"{base} (float8)"
    if "weight" in halves:
        return f"{base}{fp8.SCALE_SUFFIXES[0]} (or {fp8.SCALE_SUFFIXES[1]})"
    return base + ("_scales" if "blocks" in halves else "_blocks")


def _joined(file: Path, base: str, half: str, tensor: torch.Tensor, packed: dict, targets: dict[str, torch.Tensor],
            config: ModelConfig | None) -> tuple[str, torch.Tensor | None]:
    """(the quantized tensor's name, its values as the checkpoint's unquantized tensor would hold
    them, on its parameter's device and dtype) once both its halves are in `packed`, with `tensor`
    (its half `half`); before then its values are None."""
    halves = packed.setdefault(base, {})
    halves[half] = tensor
    ints = _int_scheme(config)
    if len(halves) < (2 if ints is None else len(ints.parts())):
        return base, None
    del packed[base]
    target = next((targets[n] for n in _filled(base, config) if n in targets), None)
    if target is None:
        raise CheckpointError(f"{file}: quantized tensor {base!r} has no matching parameter")
    device, dtype = target.device, target.dtype
    try:
        if ints is not None:
            return base, int_weights.dequantize({k: v.to(device) for k, v in halves.items()}, ints, dtype)
        if half in ("weight", "scale"):
            return base, fp8.dequantize(halves["weight"].to(device), halves["scale"].to(device),
                                        config.weight_block_size, dtype)
        return base, mxfp4.dequantize(halves["blocks"].to(device), halves["scales"].to(device), dtype).transpose(-1, -2)
    except ValueError as exc:
        raise CheckpointError(f"{file}: tensor {base!r}: {exc}") from exc


def _read(handle, name: str, part: ShardSlice | None) -> torch.Tensor:
    """The tensor, or only the part a rank holds (read from the file without the rest)."""
    if part is None:
        return handle.get_tensor(name)
    index = (slice(None),) * part.dim + (slice(part.start, part.stop),)
    return handle.get_slice(name)[index]


def tensor_key(tensor: torch.Tensor) -> tuple[int, tuple]:
    """Where a tensor's values live: tied weights (one tensor, two names) have one key."""
    return tensor.data_ptr(), tuple(tensor.shape)


def _iter_with_files(path: str | Path, awq_layout: bool = False) -> Iterator[tuple[Path, str, object]]:
    """Yield (file, name, open safetensors handle) per tensor; the file is kept so errors can name it.
    `awq_layout`: AutoAWQ's tensors read as pack-quantized ones (`awq.AwqHandle`)."""
    weights = _weights_file(path)
    if weights.name == SINGLE_FILE:
        yield from _iter_file(weights, None, awq_layout)
        return
    for shard, names in _read_index(weights).items():
        yield from _iter_file(shard, names, awq_layout)


def _weights_file(path: str | Path) -> Path:
    """`model.safetensors`, else the shard index `model.safetensors.index.json`."""
    root = _checkpoint_dir(path)
    for file in (root / SINGLE_FILE, root / INDEX_FILE):
        if file.is_file():
            return file
    raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")


def _read_index(index: Path) -> dict[Path, list[str]]:
    """Map each shard file to the tensor names the index assigns to it; every shard must exist."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: missing or empty field 'weight_map'")
    shards: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(index.parent / shard, []).append(name)
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard listed in {index} does not exist")
    return shards


def _iter_file(file: Path, names: list[str] | None, awq_layout: bool = False) -> Iterator[tuple[Path, str, object]]:
    """Tensors of one safetensors file: all of them, or only `names` (those a shard index lists)."""
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    with handle as f:
        present = set(f.keys())
        read = awq.AwqHandle(f) if awq_layout else f
        for name in names if names is not None else sorted(present):
            if name not in present:
                raise CheckpointError(f"{file}: tensor {name!r} listed in the index is not in this shard")
            for ours in awq.names_of(name) if awq_layout else (name,):
                yield file, ours, read


def _checkpoint_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    return root


def read_json(file: Path) -> dict:
    """A JSON object file; missing, malformed or non-object files raise CheckpointError naming it."""
    if not file.is_file():
        raise CheckpointError(f"{file}: file not found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
