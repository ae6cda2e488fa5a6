"""Resolve a model name ("demo" or a checkpoint directory) to a ready model, tokenizer, device and dtype."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.demo import DEMO_SEED, demo_model_config, demo_tokenizer
from splitserve.engine.engine_config import EngineConfig, check_device
from splitserve.engine.dummy_weights import init_dummy_weights
from splitserve.engine.loader import load_model_config, load_weights
from splitserve.engine.lora_adapter import load_adapter
from splitserve.engine.model.llama import LlamaForCausalLM, Reduce
from splitserve.engine.model.lora import LoraSlots, attach_adapters
from splitserve.engine.model.sharding import Shard, check_shardable
from splitserve.engine.tokenizer import Tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    model: LlamaForCausalLM
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


def resolve_device(name: str) -> torch.device:
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    return DTYPES.get(config.torch_dtype.removeprefix("torch."), torch.float32)


def resolve_max_model_len(config: ModelConfig, requested: int | None) -> int:
    """Capped by the positions the model knows (a sliding window caps nothing: its layers attend to
    the latest `sliding_window` positions of any context)."""
    limit = config.max_positions
    if requested is not None and requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens")
    return requested or limit


def load_metadata(model: str, engine: EngineConfig) -> tuple[ModelConfig, Tokenizer, int]:
    """The model's config, tokenizer and context limit, without weights (what an ingress needs)."""
    if model == "demo":
        config, tokenizer = demo_model_config(), demo_tokenizer()
    else:
        config, tokenizer = load_model_config(model), load_tokenizer(model)
    return config, tokenizer, resolve_max_model_len(config, engine.max_model_len)


def build_model(model: str, engine: EngineConfig, shard: Shard = Shard(), reduce: Reduce | None = None) -> LoadedModel:
    """The model, or with tensor parallelism this rank's `shard` of it (only its part is read from
    the checkpoint), with its LoRA adapters. Each rank sees its own device as the default one (Ray
    gives an actor its GPU)."""
    config, tokenizer, max_len = load_metadata(model, engine)
    check_shardable(config, shard.size)
    adapters = [load_adapter(name, path) for name, path in engine.lora_modules]
    device, dtype = resolve_device(engine.device), resolve_dtype(engine.dtype, config)
    with torch.device(device), default_dtype(dtype):
        net = LlamaForCausalLM(config, max_len, shard, reduce).eval()
    if model == "demo" or engine.load_format == "dummy":
        # the demo's weights are one generator's, as they always were (tests pin its greedy text)
        init_dummy_weights(net, DEMO_SEED if model == "demo" else engine.seed, runs=model != "demo")
    else:
        load_weights(net, model)
    if engine.max_loras:  # slots for adapters loaded later too: every projection, at max_lora_rank
        net.lora_slots = LoraSlots(engine.max_loras, engine.max_lora_rank, at_run_time=True,
                                   host_capacity=engine.host_loras)
    else:
        net.lora_slots = LoraSlots(len(adapters), max((adapter.rank for adapter in adapters), default=0))
    attach_adapters(net, net.lora_slots, adapters, dtype, device, every_projection=engine.max_loras > 0)
    return LoadedModel(config, tokenizer, net, device, dtype, max_len)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Floating-point tensors created inside take `dtype` (a model's parameters as it is built;
    quantized codes and scales keep their own)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
