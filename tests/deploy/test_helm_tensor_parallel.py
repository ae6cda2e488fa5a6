"""Tensor-parallel pools in the chart: workers = replicas x gpusPerPod / tensorParallelSize, each
rank one GPU of its pod; the presets run Llama-2-70B at TP 8."""
from __future__ import annotations

import pytest

from tests.deploy.helm_helpers import (
    PRESETS,
    check_pools_fill_their_pods,
    cluster_config,
    gpu_limit,
    ray_resources,
    rayservice,
    validate_rayservice,
    worker_groups,
)


@pytest.mark.parametrize("preset", PRESETS, ids=str)
def test_the_presets_run_llama_2_70b_at_tp_8_one_worker_per_8_gpu_pod(preset):
    service = rayservice(preset)
    config = cluster_config(service)
    assert config.model == "/models/meta-llama/Llama-2-70b-hf"
    for pool in config.pools:
        group = worker_groups(service)[pool.role]
        assert (gpu_limit(group["template"]["spec"]["containers"][0]), group["rayStartParams"]["num-gpus"]) == (8, "8")
        assert (pool.tensor_parallel_size, pool.num_workers) == (8, group["replicas"])
        assert pool.resources.num_gpus == 1 and pool.resources.resources == {f"splitserve-{pool.role}": 1}
        assert int(group["rayStartParams"]["num-cpus"]) == 8 * pool.resources.num_cpus


def test_a_preset_takes_its_model_from_a_claim_instead():
    config = cluster_config(rayservice("values-splitwise-hh.yaml", "model.huggingface.id=", "model.pvc.claimName=w",
                                       "model.pvc.path=llama/Llama-2-70b-hf"))
    assert config.model == "/models/llama/Llama-2-70b-hf"


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_tp_2_pool_on_8_gpu_pods_runs_4_workers_a_pod(replicas):
    service = rayservice("values-splitwise-hh.yaml", "pools.token.tensorParallelSize=2",
                         f"pools.token.replicas={replicas}")
    validate_rayservice(service)
    config = check_pools_fill_their_pods(service)
    prompt, token = config.pools
    assert (token.tensor_parallel_size, token.num_workers) == (2, 4 * replicas)
    assert (prompt.tensor_parallel_size, prompt.num_workers) == (8, 1)  # pools may differ
    assert ray_resources(worker_groups(service)["token"]) == {"splitserve-token": 8}  # 4 workers x 2 ranks


def test_tensor_parallel_1_is_one_worker_per_gpu():
    config = check_pools_fill_their_pods(rayservice("values-baseline.yaml", "pools.mixed.tensorParallelSize=1"))
    assert [(p.tensor_parallel_size, p.num_workers) for p in config.pools] == [(1, 16)]
