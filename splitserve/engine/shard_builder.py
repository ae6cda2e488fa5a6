"""What every rank of a worker builds: its part of the model, its KV cache and a model runner.
Without tensor parallelism the one rank holds everything."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from splitserve.engine.attention import AttentionBackend, fp8_kv, select_backend
from splitserve.engine.config import ConfigError
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.host_kv_blocks import HostKVBlocks
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.kv_memory_check import check_kv_cache_fits
from splitserve.engine.memory_profile import kv_cache_budget, profile_lengths
from splitserve.engine.model.sharding import Shard
from splitserve.engine.model_builder import LoadedModel, build_model
from splitserve.engine.model_runner import ModelRunner, StepChannel
from splitserve.engine.tensor_parallel import TPGroup

log = logging.getLogger("splitserve.engine")


@dataclass(frozen=True)
class EngineShard:
    loaded: LoadedModel
    kv_cache: KVCache
    runner: ModelRunner
    host_kv: HostKVBlocks | None = None  # the host tier's memory (kv_host_cache_bytes), this rank's heads

    @property
    def model_config(self):
        return self.loaded.config

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len


def build_shard(model: str, config: EngineConfig, group: TPGroup | None = None,
                channel: StepChannel | None = None) -> EngineShard:
    """This rank's model part, KV cache and runner. The cache is sized after the model is loaded
    (on CUDA by a memory profile, which every rank of a group runs in lockstep). With a group, every
    rank gets the same number of KV blocks (the fewest any rank's memory allows), so a block id
    means the same on all. A cache larger than the device's free memory is refused before it is
    allocated (`kv_memory_check`). On CUDA the runner's Triton kernels are then compiled
    (`kernel_warm_up`, on every rank) and its decode graphs captured, before it serves."""
    shard = Shard(group.rank, group.size) if group is not None else Shard()
    loaded = build_model(model, config, shard, group.all_reduce if group is not None else None)
    backend = select_backend(loaded.device, config.attention_backend)
    block_bytes = KVCache.bytes_per_block(loaded.config, config.block_size, loaded.dtype, shard, config.kv_cache_dtype)
    num_blocks = config.num_kv_blocks or kv_cache_budget(config, loaded, backend, shard) // block_bytes
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    groups = kv_groups(loaded.config)
    # a token takes a block of each layer group's (BlockManager); a window takes NULL_BLOCK
    tokens = (num_blocks - any(w is not None for w in groups.windows)) // groups.num_groups * config.block_size
    if tokens < loaded.max_model_len:
        raise ConfigError(f"the KV cache holds {tokens} tokens, fewer than max_model_len="
                          f"{loaded.max_model_len}; raise kv_cache_memory_bytes (on CUDA, gpu_memory_utilization) or "
                          "lower max_model_len")
    # after min_int: the ranks have agreed, so a rank short of memory raises alone and strands none in it
    check_kv_cache_fits(config, num_blocks, block_bytes, loaded.device, shard)
    kv_cache = KVCache(loaded.config, num_blocks, config.block_size, loaded.dtype, loaded.device, shard,
                       config.kv_cache_dtype)
    if fp8_kv.is_fp8(config.kv_cache_dtype):
        log_fp8_scales(loaded.model)
    host_kv = None
    if config.kv_host_cache_bytes:
        slots = HostKVBlocks.num_slots(kv_cache, config.kv_host_cache_bytes)
        host_kv = HostKVBlocks(kv_cache, group.min_int(slots) if group is not None else slots)
    runner = ModelRunner(loaded.model, kv_cache, backend, loaded.device, channel)
    if loaded.device.type == "cuda":
        from splitserve.engine.kernel_warm_up import warm_up  # triton: CUDA builds of torch bring it

        warm_up(runner, sum(profile_lengths(config, loaded.max_model_len)))  # the largest step's tokens
    if _captures_graphs(config, loaded, backend, group):
        runner.graphs = DecodeGraphs(runner, backend, min(config.cuda_graph_max_batch, config.max_num_seqs),
                                     loaded.max_model_len)
        runner.graphs.capture()
    return EngineShard(loaded, kv_cache, runner, host_kv)


def log_fp8_scales(model: nn.Module) -> None:
    """How many layers' FP8 KV scales the checkpoint set: with 1.0 a K or V value over 448 saturates."""
    scales = [m.kv_scale for m in model.modules() if hasattr(m, "kv_scale")]
    scaled = sum(scale != (1.0, 1.0) for scale in scales)
    log.info("FP8 KV cache (e4m3): %d of %d attention layers scaled by the checkpoint's k_scale / v_scale, the "
             "others by 1.0 (values past +-448 saturate)", scaled, len(scales))


def _captures_graphs(config: EngineConfig, loaded: LoadedModel, backend: AttentionBackend,
                     group: TPGroup | None) -> bool:
    """On CUDA with a graph-safe backend, one rank: a captured all-reduce would need every rank
    to capture and replay in lockstep, which tensor-parallel steps do not promise."""
    return loaded.device.type == "cuda" and config.cuda_graph_max_batch > 0 and backend.graph_safe and group is None
