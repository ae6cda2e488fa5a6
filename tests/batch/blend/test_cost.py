"""BlendServe's cost model against the paper's own numbers (Fig. 5, §3.4 and Table 3)."""
from __future__ import annotations

import pytest

from splitserve.batch.blend.cost import Accelerator, CostModel, ModelShape, partition
from splitserve.batch.blend.tree import OfflineRequest, annotate, build_tree, estimate_outputs

LLAMA31_8B = ModelShape(8.03e9, 4096, 1024, 32)  # H_kv: 8 KV heads x 128


def test_fig5_densities_on_an_a100():
    cost = CostModel(LLAMA31_8B, Accelerator(312e12, 2.0e12))
    assert cost.density(512, 256) == pytest.approx(3.73, rel=0.03)
    assert cost.density(256, 16384) == pytest.approx(0.096, rel=0.03)


def test_kv_bytes_per_token_and_capacity():
    assert LLAMA31_8B.kv_bytes_per_token == 131072
    assert 450_000 < 60e9 / LLAMA31_8B.kv_bytes_per_token < 500_000  # "nearly 500K tokens" in 60 GB


def test_memory_partition_of_fig5():
    left, right = partition(60.0, 3.73, 0.096, 1.27)
    assert (left, right) == (pytest.approx(19.38, abs=0.01), pytest.approx(40.62, abs=0.01))
    assert left * 3.73 + right * 0.096 == pytest.approx(60 * 1.27)


@pytest.mark.parametrize("target, expected", [(5.0, (60.0, 0.0)), (0.01, (0.0, 60.0))])
def test_partition_clamps_a_target_outside_the_two_densities(target, expected):
    assert partition(60.0, 3.73, 0.096, target) == expected


def test_partition_splits_evenly_when_the_sides_are_equally_dense():
    assert partition(10.0, 1.0, 1.0, 3.0) == (5.0, 5.0)


def test_mmlu_like_trace_density_includes_the_sharing_discount():
    """Table 3: MMLU (2 output tokens, 86% sharing) has rho 54.91; per request it is ~400."""
    shared = tuple(range(865))
    requests = [OfflineRequest(i, shared + tuple(1000 + i * 200 + k for k in range(135)), 2, 2) for i in range(400)]
    root = build_tree(requests)
    estimate_outputs(root, {})
    cost = CostModel(LLAMA31_8B, Accelerator(312e12, 2.0e12))
    annotate(root, cost)
    assert root.stats.sharing() == pytest.approx(0.8646, abs=0.002)
    assert 50 < root.rho < 56
    assert 380 < cost.density(1000, 2) < 420


def test_model_shape_of_a_config_counts_every_gemm():
    from splitserve.engine.demo import demo_model_config

    config = demo_model_config()
    shape = ModelShape.of(config)
    per_layer = 256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 688
    assert shape.params == 4 * per_layer + 256 * 259 and shape.kv_width == 128 and shape.layers == 4


def test_model_shape_of_an_moe_counts_the_routed_experts_only():
    """Qwen3-30B-A3B: about 3.3B parameters a token passes through (the model card's 3.3B
    activated, of 30.5B), where a dense reading of its config would count 0.9B of MLP."""
    from splitserve.engine.config import ModelConfig
    from splitserve.engine.shapes import QWEN3_30B_A3B

    config = ModelConfig.from_hf(QWEN3_30B_A3B)
    shape = ModelShape.of(config)
    assert 3.2e9 < shape.params + 151936 * 2048 < 3.4e9  # the card counts the input embedding too
    dense_first = ModelShape.of(ModelConfig.from_hf({**QWEN3_30B_A3B, "mlp_only_layers": [0]}))
    assert dense_first.params - shape.params == 3 * 2048 * 6144 - (2048 * 128 + 3 * 2048 * 768 * 8)


def test_bad_accelerator_is_rejected():
    with pytest.raises(ValueError, match="flops and bandwidth"):
        Accelerator(0, 1e12)
