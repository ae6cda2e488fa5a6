"""Refuses a KV cache the device's free memory cannot hold, before it is allocated: otherwise a
too large num_kv_blocks or kv_cache_memory_bytes ends in an allocator traceback (CUDA out of
memory, CPU can't allocate) or, on a CPU that overcommits, in the OOM killer."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES
from splitserve.engine.model.sharding import Shard

MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"  # cgroup v2: a container's memory.max and memory.current


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take now: on CUDA the driver's free memory; on CPU
    Linux's MemAvailable, else the free physical pages, and at most what the container's memory
    limit leaves (a pod past it is OOM-killed whatever the machine has); None where none is known."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the allocator's cached free blocks would serve the cache too
        return torch.cuda.mem_get_info(device)[0]
    known = [x for x in (_machine_free(), _container_room()) if x is not None]
    return min(known, default=None)


def _container_room() -> int | None:
    """memory.max - memory.current of the cgroup at CGROUP, a container's own under cgroup v2's
    namespaces (None: no limit, or no cgroup v2)."""
    try:
        limit = Path(CGROUP, "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path(CGROUP, "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _machine_free() -> int | None:
    try:
        with open(MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # meminfo counts kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not every platform names these
        return None


def check_kv_cache_fits(config: EngineConfig, num_blocks: int, block_bytes: int, device: torch.device,
                        shard: Shard = Shard()) -> None:
    """ConfigError naming the setting that sized the cache when `num_blocks` blocks of `block_bytes`
    exceed what `device` has free. A budget the CUDA memory profile computed is not checked: it is
    at most the free memory the profile measured."""
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        return
    free, asked = free_bytes(device), num_blocks * block_bytes
    if free is None or asked <= free:
        return
    fits = free // block_bytes
    where = str(device) if shard.size == 1 else f"{device} (rank {shard.rank} of {shard.size})"
    raise ConfigError(f"{_setting(config)} asks for a KV cache of {num_blocks} blocks = {asked} bytes, but {where} "
                      f"has {free} bytes free; at most num_kv_blocks={fits} fit "
                      f"(kv_cache_memory_bytes={fits * block_bytes})")


def _setting(config: EngineConfig) -> str:
    if config.num_kv_blocks is not None:
        return f"num_kv_blocks={config.num_kv_blocks}"
    if config.kv_cache_memory_bytes is not None:
        return f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    return f"the CPU default KV budget ({CPU_KV_CACHE_BYTES} bytes)"
