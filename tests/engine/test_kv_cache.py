"""KV cache tensors: sizing, and per-layer views."""
import pytest
import torch

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.demo import demo_model_config
from splitserve.engine.kv_cache import CPU_KV_CACHE_BYTES, KVCache, gpu_budget, kv_cache_budget

CONFIG = demo_model_config()  # 4 layers, 4 kv heads, head_dim 32
GiB = 2**30


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    per_token = 2 * 4 * 4 * 32
    assert KVCache.bytes_per_block(CONFIG, 16, torch.float32) == per_token * 16 * 4
    assert KVCache.bytes_per_block(CONFIG, 16, torch.bfloat16) == per_token * 16 * 2


def test_layers_are_views_of_the_cache():
    cache = KVCache(CONFIG, 6, 16, torch.bfloat16, torch.device("cpu"))
    assert len(cache.layers()) == 4 and cache.layers()[2].shape == (2, 6, 16, 4, 32)
    cache.layers()[2][1, 3].fill_(1)
    assert torch.count_nonzero(cache.data) == 16 * 4 * 32


def test_budget_explicit_wins_and_cpu_has_a_default():
    cpu = torch.device("cpu")
    assert kv_cache_budget(EngineConfig(kv_cache_memory_bytes=12345), cpu) == 12345
    assert kv_cache_budget(EngineConfig(), cpu) == CPU_KV_CACHE_BYTES


def test_gpu_budget_leaves_room_for_what_is_in_use():
    # 80 GiB GPU, 20 GiB already used (weights): 0.9 * 80 - 20 = 52 GiB for the KV cache
    assert gpu_budget(free=60 * GiB, total=80 * GiB, utilization=0.9) == int(72 * GiB) - 20 * GiB
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.2"):
        gpu_budget(free=60 * GiB, total=80 * GiB, utilization=0.2)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_gpu_memory_utilization_must_be_a_fraction(bad):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)
