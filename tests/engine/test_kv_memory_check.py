"""The KV cache against the device's free memory (`splitserve.engine.kv_memory_check`): a cache the
memory cannot hold is a ConfigError naming the setting that sized it and the most blocks that fit,
raised before anything is allocated. On CPU with the demo model; CUDA's free memory is faked."""
from __future__ import annotations

import os
import re
import threading

import pytest
import torch

from splitserve.engine import kv_memory_check
from splitserve.engine.config import ConfigError
from splitserve.engine.demo import demo_model_config
from splitserve.engine.engine_config import MAX_KV_BLOCKS, EngineConfig
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES, KVCache
from splitserve.engine.kv_memory_check import check_kv_cache_fits, free_bytes
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.sharding import Shard
from tests.engine.tp_helpers import Followers, join, store_server

ENGINE = dict(device="cpu", max_model_len=80)
CPU = torch.device("cpu")
BLOCK_BYTES = KVCache.bytes_per_block(demo_model_config(), 16, torch.float32)  # the demo model's: 64 KiB


def give(monkeypatch, free: int | None) -> None:
    """The device has `free` bytes free (None: unknown)."""
    monkeypatch.setattr(kv_memory_check, "free_bytes", lambda device: free)


# ---- what the engine refuses ----------------------------------------------------------------------
@pytest.mark.parametrize("setting", [dict(num_kv_blocks=MAX_KV_BLOCKS), dict(kv_cache_memory_bytes=10**15)])
def test_a_cache_larger_than_this_machine_names_the_setting_and_what_fits(setting):
    (name, value), = setting.items()
    refusal = rf"^{name}={value} asks .* bytes free; at most num_kv_blocks=\d+ fit"
    with pytest.raises(ConfigError, match=refusal) as error:
        LLMEngine("demo", **ENGINE, **setting)
    fits = int(re.search(r"at most num_kv_blocks=(\d+)", str(error.value))[1])
    assert 0 < fits * BLOCK_BYTES <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_cache_that_exactly_fits_is_built_and_one_block_more_is_not(monkeypatch):
    give(monkeypatch, 64 * BLOCK_BYTES)
    assert LLMEngine("demo", **ENGINE, num_kv_blocks=64).kv_cache.num_blocks == 64
    assert LLMEngine("demo", **ENGINE, kv_cache_memory_bytes=65 * BLOCK_BYTES - 1).kv_cache.num_blocks == 64
    message = (f"num_kv_blocks=65 asks for a KV cache of 65 blocks = {65 * BLOCK_BYTES} bytes, but cpu has "
               f"{64 * BLOCK_BYTES} bytes free; at most num_kv_blocks=64 fit "
               f"(kv_cache_memory_bytes={64 * BLOCK_BYTES})")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        LLMEngine("demo", **ENGINE, num_kv_blocks=65)
    with pytest.raises(ConfigError, match=rf"^kv_cache_memory_bytes={65 * BLOCK_BYTES} asks .* num_kv_blocks=64 fit"):
        LLMEngine("demo", **ENGINE, kv_cache_memory_bytes=65 * BLOCK_BYTES)


def test_the_cpu_default_budget_is_checked_too(monkeypatch):
    give(monkeypatch, CPU_KV_CACHE_BYTES - 1)
    with pytest.raises(ConfigError, match=rf"^the CPU default KV budget \({CPU_KV_CACHE_BYTES} bytes\) asks .* "
                                          rf"at most num_kv_blocks={CPU_KV_CACHE_BYTES // BLOCK_BYTES - 1} fit"):
        LLMEngine("demo", **ENGINE)


def test_a_budget_the_cuda_profile_computed_is_not_checked_again(monkeypatch):
    """The profile's budget is at most the free memory it measured; a user's setting is checked."""
    give(monkeypatch, 0)
    cuda = torch.device("cuda", 0)
    check_kv_cache_fits(EngineConfig(), 10**6, BLOCK_BYTES, cuda)
    with pytest.raises(ConfigError, match=r"^num_kv_blocks=7 .* but cuda:0 has 0 bytes free; at most num_kv_blocks=0"):
        check_kv_cache_fits(EngineConfig(num_kv_blocks=7), 7, BLOCK_BYTES, cuda)
    with pytest.raises(ConfigError, match=r"^kv_cache_memory_bytes=1000 "):
        check_kv_cache_fits(EngineConfig(kv_cache_memory_bytes=1000), 7, BLOCK_BYTES, cuda)


def test_unknown_free_memory_is_not_checked(monkeypatch):
    give(monkeypatch, None)
    check_kv_cache_fits(EngineConfig(num_kv_blocks=MAX_KV_BLOCKS), MAX_KV_BLOCKS, BLOCK_BYTES, CPU)


def test_a_rank_short_of_memory_refuses_once_the_ranks_agree(monkeypatch):
    """TP 2 on threads: rank 1 has room for 40 of the 64 blocks asked, rank 0 for all. Rank 1
    raises after min_int, so rank 0 is not left waiting in it: it builds its shard (and would find
    rank 1 gone at its first step, as with any rank that fails)."""
    rank_bytes = BLOCK_BYTES // 2  # 2 of the 4 KV heads
    main = threading.main_thread()
    monkeypatch.setattr(kv_memory_check, "free_bytes",
                        lambda device: (64 if threading.current_thread() is main else 40) * rank_bytes)
    config, server = EngineConfig(**ENGINE, num_kv_blocks=64), store_server()
    followers = Followers(server, "kv-memory", 2, "demo", config, timeout=10.0)
    engine = LLMEngine("demo", config, tp=join(server, "kv-memory", 0, 2, 10.0))
    followers.join()
    assert engine.kv_cache.num_blocks == 64 and not followers.followers
    error = followers.errors[1]
    assert isinstance(error, ConfigError)
    assert re.match(r"num_kv_blocks=64 .* but cpu \(rank 1 of 2\) has \d+ bytes free; at most num_kv_blocks=40 ",
                    str(error))


# ---- the device's free memory ---------------------------------------------------------------------
def test_free_memory_on_cpu_is_mem_available(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(kv_memory_check, "MEMINFO", str(meminfo))
    assert free_bytes(CPU) == 2048 * 1024


def test_free_memory_on_cpu_falls_back_to_free_pages_then_to_unknown(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000 kB\nMemFree:         1000 kB\n")  # before Linux 3.14
    monkeypatch.setattr(kv_memory_check, "MEMINFO", str(meminfo))
    monkeypatch.setattr(kv_memory_check.os, "sysconf", {"SC_AVPHYS_PAGES": 3, "SC_PAGE_SIZE": 4096}.get)
    assert free_bytes(CPU) == 3 * 4096
    monkeypatch.setattr(kv_memory_check, "MEMINFO", str(tmp_path / "missing"))
    assert free_bytes(CPU) == 3 * 4096

    def unnamed(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(kv_memory_check.os, "sysconf", unnamed)
    assert free_bytes(CPU) is None


def test_free_memory_on_cpu_is_at_most_the_room_the_containers_limit_leaves(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    2048 kB\n")
    monkeypatch.setattr(kv_memory_check, "MEMINFO", str(meminfo))
    monkeypatch.setattr(kv_memory_check, "CGROUP", str(tmp_path))
    assert free_bytes(CPU) == 2048 * 1024  # not in a cgroup v2
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000000\n")
    assert free_bytes(CPU) == 2048 * 1024  # no limit
    (tmp_path / "memory.max").write_text("1500000\n")
    assert free_bytes(CPU) == 500_000
    (tmp_path / "memory.current").write_text("1600000\n")  # past it: the kernel reclaims, else kills
    assert free_bytes(CPU) == 0
    (tmp_path / "memory.max").write_text("2000000000\n")
    assert free_bytes(CPU) == 2048 * 1024  # the machine's is the lesser


def test_free_memory_on_this_machine_is_some_of_its_memory():
    assert 0 < free_bytes(CPU) <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_free_memory_on_cuda_is_the_drivers_once_the_allocators_cache_is_released(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append(device) or (123, 456))
    assert free_bytes(torch.device("cuda", 1)) == 123
    assert calls == ["empty_cache", torch.device("cuda", 1)]


def test_a_shard_is_named_by_its_rank(monkeypatch):
    give(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"but cpu \(rank 2 of 4\) has 0 bytes free"):
        check_kv_cache_fits(EngineConfig(num_kv_blocks=1), 1, BLOCK_BYTES, CPU, Shard(2, 4))
