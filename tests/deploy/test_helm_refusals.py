"""Values the chart refuses, each with a message naming the value."""
from __future__ import annotations

import pytest

from tests.deploy.helm_helpers import render_error


@pytest.mark.parametrize("sets, message", [
    (("model.demo=false",), "set exactly one model source, found 0"),
    (("model.huggingface.id=org/model",), "set exactly one model source, found 2"),
    (("model.demo=false", "model.pvc.claimName=weights"), "model.pvc.path"),
    (("pools.token.tensorParallelSize=2",), "pools.token.tensorParallelSize=2 does not divide gpusPerPod=1"),
    (("pools.token.gpusPerPod=8", "pools.token.tensorParallelSize=3"),
     "pools.token.tensorParallelSize=3 does not divide gpusPerPod=8"),
    (("pools.mixed.enabled=true", "pools.mixed.tensorParallelSize=0"),
     "pools.mixed.tensorParallelSize=0: give the GPUs of one worker, a whole number of at least 1"),
    (("pools.prompt.tensorParallelSize=-2",), "pools.prompt.tensorParallelSize=-2: give the GPUs of one worker"),
    (("pools.prompt.tensorParallelSize=0.5",), "pools.prompt.tensorParallelSize=0.5: give the GPUs of one worker"),
    (("pools.token.enabled=false",), "the prompt and token pools go together"),
    (("pools.prompt.gpusPerPod=0",), "pools.prompt: replicas and gpusPerPod must be at least 1"),
    (("pools.prompt.cpusPerRank=1.5",), "pools.prompt.cpusPerRank=1.5: use a whole number"),
    (("pools.prompt.cpusPerWorker=4",), "pools.prompt.cpusPerWorker: renamed cpusPerRank"),
    (("cluster.pools=x",), "cluster.pools: set it through the chart's model and pools values"),
    (("cluster.batch.dir=/data",), "cluster.batch.dir: the chart keeps the batch API's store at /batches"),
], ids=["no-model", "two-models", "pvc-without-path", "tp-not-dividing-1-gpu", "tp-not-dividing-8-gpus",
        "tp-0", "tp-negative", "tp-fractional", "prompt-without-token", "no-gpus", "fractional-cpus",
        "cpus-per-worker-renamed", "pools-in-cluster", "batch-dir-in-cluster"])
def test_refuses(sets, message):
    assert message in render_error(None, *sets)
