"""KV cache tensors: sizing, and per-layer views."""
import pytest
import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.demo import demo_model_config
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.kv_cache import KVCache

CONFIG = demo_model_config()  # 4 layers, 4 kv heads, head_dim 32


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    per_token = 2 * 4 * 4 * 32
    assert KVCache.bytes_per_block(CONFIG, 16, torch.float32) == per_token * 16 * 4
    assert KVCache.bytes_per_block(CONFIG, 16, torch.bfloat16) == per_token * 16 * 2


def test_layers_are_views_of_the_cache():
    cache = KVCache(CONFIG, 6, 16, torch.bfloat16, torch.device("cpu"))
    assert len(cache.layers()) == 4 and cache.layers()[2].shape == (2, 6, 16, 4, 32)
    cache.layers()[2][1, 3].fill_(1)
    assert torch.count_nonzero(cache.data) == 16 * 4 * 32


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_gpu_memory_utilization_must_be_a_fraction(bad):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)
