"""The chart's Serve app args are a splitserve ClusterConfig that its worker groups can run, checked
against Ray Serve's config schema and a hand-written table of what each preset is meant to deploy;
the presets deploy deploy/*.yaml; the model sources; the batch API's store on the head pod."""
from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from splitserve.config import ClusterConfig
from tests.deploy.helm_helpers import (
    ROOT,
    check_pools_fill_their_pods,
    cluster_config,
    ids,
    pod_templates,
    rayservice,
    serve_config,
    worker_groups,
)

H100, A100 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"
# preset -> {pool role: (hardware class, GPU product the pool is pinned to, tensor parallel size)}
POOLS = {
    None: {"prompt": ("h100", None, 1), "token": ("h100", None, 1)},
    "values-splitwise-ha.yaml": {"prompt": ("h100", H100, 8), "token": ("a100", A100, 8)},
    "values-splitwise-hhcap.yaml": {"prompt": ("h100", H100, 8), "token": ("h100-cap", H100, 8)},
    "values-splitwise-hh.yaml": {"prompt": ("h100", H100, 8), "token": ("h100", H100, 8)},
    "values-baseline.yaml": {"mixed": ("h100", H100, 8)},
}
DEPLOY_CONFIGS = {"values-splitwise-ha.yaml": "splitwise-ha.yaml",
                  "values-splitwise-hhcap.yaml": "splitwise-hhcap.yaml", "values-baseline.yaml": "baseline.yaml"}


@ids
def test_serve_config_is_a_cluster_config_matching_the_worker_groups(preset):
    service = rayservice(preset)
    ServeDeploySchema.model_validate(serve_config(service))  # what KubeRay hands Serve
    config = check_pools_fill_their_pods(service)
    assert {p.role: (p.hardware, p.tensor_parallel_size) for p in config.pools} == \
        {r: (hw, tp) for r, (hw, _, tp) in POOLS[preset].items()}
    groups = worker_groups(service)
    for pool in config.pools:
        product = POOLS[preset][pool.role][1]
        assert groups[pool.role]["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product") == product
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert "nvidia.com/gpu" not in str(head["template"])


@pytest.mark.parametrize("preset", DEPLOY_CONFIGS, ids=str)
def test_preset_deploys_the_cluster_of_its_deploy_config(preset):
    """The presets are deploy/*.yaml on whole nodes: same pools, hardware and engine settings."""
    chart = cluster_config(rayservice(preset))
    apps = yaml.safe_load((ROOT / "deploy" / DEPLOY_CONFIGS[preset]).read_text())["applications"]
    deploy = ClusterConfig.model_validate(apps[0]["args"])
    def design(config):
        return {p.role: (p.hardware, p.tensor_parallel_size, p.resources.num_gpus, p.resources.num_cpus)
                for p in config.pools}
    assert design(chart) == design(deploy)
    assert chart.model.endswith("Llama-2-70b-hf") and deploy.model.endswith("Llama-2-70b-hf")
    for section in ("engine", "transfer", "scheduler", "ingress"):
        assert getattr(chart, section) == getattr(deploy, section), section


def test_model_sources():
    demo = rayservice()
    assert cluster_config(demo).model == "demo" and "initContainers" not in str(demo)
    hf = rayservice(None, "model.demo=false", "model.huggingface.id=org/model", "model.huggingface.revision=v2",
                    "model.huggingface.tokenSecret.name=hf")
    config = cluster_config(hf)
    assert (config.model, config.served_model_name) == ("/models/org/model", "org/model")
    for name, template in pod_templates(hf).items():
        download = next(c for c in template["spec"]["initContainers"] if c["name"] == "model-download")
        args = download["command"][3:]
        patterns = ["*.json", "*.jinja"] + ([] if name == "head" else ["*.safetensors"])
        assert args == ["org/model", "v2", "/models/org/model", *patterns]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in download["env"]
        main = template["spec"]["containers"][0]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        assert {"name": "model", "emptyDir": {}} in template["spec"]["volumes"]
    pvc = rayservice(None, "model.demo=false", "model.pvc.claimName=weights", "model.pvc.path=llama/13b")
    assert cluster_config(pvc).model == "/models/llama/13b"
    for template in pod_templates(pvc).values():
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in \
            template["spec"]["volumes"]
        assert "initContainers" not in template["spec"]


def test_the_batch_store_is_a_volume_of_the_head_pod():
    for sets, volume in [((), {"name": "batches", "emptyDir": {}}),
                         (("head.batchesClaimName=batches", "cluster.batch.order=dfs"),
                          {"name": "batches", "persistentVolumeClaim": {"claimName": "batches"}})]:
        service = rayservice(None, *sets)
        config = cluster_config(service)
        assert config.batch.dir == "/batches"
        assert config.batch.order == ("dfs" if sets else "blend")
        templates = pod_templates(service)
        head = templates.pop("head")["spec"]
        assert volume in head["volumes"]
        assert {"name": "batches", "mountPath": "/batches"} in head["containers"][0]["volumeMounts"]
        for template in templates.values():  # the batch actor runs on the head only
            assert "batches" not in str(template["spec"].get("volumes"))
