"""KV cache tensors: sizing, and whole-block / per-layer reads and writes (what a KV transfer uses)."""
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


def test_blocks_round_trip_between_two_caches_with_different_ids():
    src = KVCache(CONFIG, 10, 16, torch.float32, torch.device("cpu"))
    dst = KVCache(CONFIG, 12, 16, torch.float32, torch.device("cpu"))
    src.data.normal_()
    blocks = src.read_blocks([7, 2, 5])
    assert blocks.shape == (4, 2, 3, 16, 4, 32)
    dst.write_blocks([0, 11, 3], blocks)
    for s, d in zip([7, 2, 5], [0, 11, 3]):
        assert torch.equal(dst.data[:, :, d], src.data[:, :, s])
    assert torch.count_nonzero(dst.data[:, :, [1, 2, 4, 5, 6, 7, 8, 9, 10]]) == 0


def test_layers_round_trip_one_at_a_time():
    src = KVCache(CONFIG, 6, 16, torch.float32, torch.device("cpu"))
    dst = KVCache(CONFIG, 6, 16, torch.bfloat16, torch.device("cpu"))
    src.data.normal_()
    for layer in range(CONFIG.num_hidden_layers):
        dst.write_layer(layer, [4, 1], src.read_layer(layer, [0, 3]))
    assert torch.equal(dst.data[:, :, [4, 1]], src.data[:, :, [0, 3]].to(torch.bfloat16))
    assert len(dst.layers()) == 4 and dst.layers()[2].shape == (2, 6, 16, 4, 32)


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
