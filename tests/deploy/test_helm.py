"""The helm chart (helm/splitserve), rendered by helm 3.6 with its defaults and every preset.

References: Kubernetes' OpenAPI schemas (kubernetes-validate), KubeRay's RayService CRD schema
(crds/), Ray Serve's config schema, splitserve's ClusterConfig, and a hand-written table of what
each preset is meant to deploy. helm: `bash scripts/install_test_tools.sh`.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from splitserve.config import APP_IMPORT_PATH, ClusterConfig
from tests.deploy.helm_helpers import (
    CHART,
    PRESETS,
    ROOT,
    containers,
    helm_binary,
    of_kind,
    pod_templates,
    render,
    render_error,
    render_notes,
    run_helm,
    serve_config,
    the,
    validate_core,
    validate_rayservice,
    value_args,
)

ALL = (None, *PRESETS)  # None: the chart's defaults
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
MONITORS = ("monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true")
SECURE = {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
          "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
ids = pytest.mark.parametrize("preset", ALL, ids=lambda p: p or "defaults")


def rayservice(preset=None, *sets):
    return the(render(preset, *sets), "RayService")


def cluster_config(service: dict) -> ClusterConfig:
    apps = [a for a in serve_config(service)["applications"] if a["import_path"] == APP_IMPORT_PATH]
    assert len(apps) == 1 and apps[0]["route_prefix"] == "/"
    return ClusterConfig.model_validate(apps[0]["args"])


def worker_groups(service: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def ray_resources(group: dict) -> dict:
    """The custom resources `ray start` gets: KubeRay passes rayStartParams through bash, and
    parses this value itself (surrounding quotes trimmed) to add accelerator resources to it."""
    value = group["rayStartParams"]["resources"]
    words = shlex.split(f"--resources={value}")
    resources = json.loads(words[0].removeprefix("--resources="))
    assert json.loads(value.strip("'\"` ")) == resources, "KubeRay could not parse it"
    return resources


def gpu_limit(container: dict) -> int:
    return int(container["resources"]["limits"]["nvidia.com/gpu"])


# --- helm itself ---------------------------------------------------------------------------------

def test_helm_is_3_6():
    """The chart claims helm 3.6 compatibility: only a 3.6 helm checks that claim."""
    version = run_helm("version", "--short").stdout
    assert version.startswith("v3.6."), (f"{helm_binary()} is helm {version.strip()}; "
                                         "run `bash scripts/install_test_tools.sh` for helm 3.6")


@ids
def test_lint_strict(preset):
    result = run_helm("lint", "--strict", str(CHART), *value_args(preset))
    assert result.returncode == 0, result.stdout + result.stderr


# --- every manifest against its schema -----------------------------------------------------------

# Values the presets leave alone: another model source and the optional settings.
OPTIONS = ("model.demo=false", "model.pvc.claimName=weights", "model.pvc.path=llama", "apiKeySecret.name=keys",
           "head.resultsClaimName=results", "imagePullSecrets[0].name=registry", "rayAuth.existingSecret=token",
           "networkPolicy.serveFrom[0].namespaceSelector.matchLabels.team=ml", "pools.prompt.acceleratorType=H100")


@pytest.mark.parametrize("preset, sets", [*((p, MONITORS) for p in ALL), (None, OPTIONS)],
                         ids=[*(p or "defaults" for p in ALL), "options"])
def test_every_manifest_validates(preset, sets):
    manifests = render(preset, *sets)
    kinds = sorted(m["kind"] for m in manifests)
    expected = ["ConfigMap", "NetworkPolicy", "RayService"]
    assert kinds == sorted(expected + (["PodMonitor", "Secret", "ServiceMonitor"] if sets == MONITORS else []))
    for manifest in manifests:
        if manifest["kind"] == "RayService":
            validate_rayservice(manifest)
        elif manifest["apiVersion"] == "monitoring.coreos.com/v1":
            check_monitor(manifest)
        else:
            validate_core(manifest)


def check_monitor(monitor: dict) -> None:
    """No schema ships for the Prometheus Operator's kinds here: their required shape by hand."""
    assert monitor["kind"] in ("ServiceMonitor", "PodMonitor")
    assert set(monitor["spec"]["selector"]) == {"matchLabels"}
    endpoints = monitor["spec"]["endpoints" if monitor["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
    assert [(e["port"], e["path"], e["scheme"]) for e in endpoints] == [("serve", "/metrics", "http")]
    assert re.fullmatch(r"\d+[smh]", endpoints[0]["interval"])


def test_the_checks_catch_a_misspelled_field():
    """A field the CRD does not name would be pruned silently by the API server."""
    service = rayservice()
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParam"] = {}
    with pytest.raises(AssertionError, match="rayStartParam"):
        validate_rayservice(service)
    policy = the(render(), "NetworkPolicy")
    policy["spec"]["ingres"] = []
    with pytest.raises(AssertionError):
        validate_core(policy)


# --- the Serve app's args are the ClusterConfig the worker groups can run --------------------------

def check_pools_fill_their_pods(service: dict) -> ClusterConfig:
    """Every pool's workers, at their tensor_parallel_size, fill its pods exactly: `resources` are
    per rank (one GPU each), so a pod's Ray GPUs, CPUs and pool resource are its workers' ranks'."""
    config = cluster_config(service)
    groups = worker_groups(service)
    assert set(groups) == {p.role for p in config.pools}
    for pool in config.pools:
        group, tp = groups[pool.role], pool.tensor_parallel_size
        gpus = gpu_limit(group["template"]["spec"]["containers"][0])
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert gpus % tp == 0 and pool.num_workers == group["replicas"] * gpus // tp
        ranks_per_pod = pool.num_workers // group["replicas"] * tp
        assert pool.resources.num_gpus == 1 and ranks_per_pod == gpus
        assert int(group["rayStartParams"]["num-gpus"]) == gpus
        assert int(group["rayStartParams"]["num-cpus"]) == ranks_per_pod * pool.resources.num_cpus
        resource = f"splitserve-{pool.role}"
        assert pool.resources.resources == {resource: 1}
        assert ray_resources(group) == {resource: ranks_per_pod}
        holders = [name for name, g in groups.items() if resource in ray_resources(g)]
        assert holders == [pool.role], f"{resource} is advertised by {holders}"
    return config


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


# --- security ------------------------------------------------------------------------------------

@ids
def test_every_container_runs_non_root_but_the_power_cap(preset):
    for name, template in pod_templates(rayservice(preset)).items():
        assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            if container["name"] == "power-cap":
                continue
            context = container["securityContext"]
            assert {k: context.get(k) for k in SECURE} == SECURE, f"{name}/{container['name']}"
            assert not context.get("privileged")


@ids
def test_power_cap_only_where_the_preset_caps(preset):
    service = rayservice(preset)
    capped = {name: [c for c in template["spec"].get("initContainers", []) if c["name"] == "power-cap"]
              for name, template in pod_templates(service).items()}
    if preset != "values-splitwise-hhcap.yaml":
        assert not any(capped.values())
        return
    assert {name for name, found in capped.items() if found} == {"token"}
    cap = capped["token"][0]
    assert cap["command"] == ["nvidia-smi", "-pl", "350"]
    assert cap["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsNonRoot": False}
    worker = worker_groups(service)["token"]["template"]["spec"]["containers"][0]
    assert gpu_limit(cap) == gpu_limit(worker) == 8  # the whole node, which the cap covers
    assert worker_groups(service)["token"]["template"]["spec"]["nodeSelector"]["splitserve.io/gpu-power"] == "capped"
    assert worker_groups(service)["prompt"]["template"]["spec"]["nodeSelector"]["splitserve.io/gpu-power"] == "full"


def test_network_policy_by_default():
    manifests = render()
    policy = the(manifests, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for template in pod_templates(the(manifests, "RayService")).values():
        assert selector.items() <= template["metadata"]["labels"].items()
    rules = policy["spec"]["ingress"]
    by_port = {tuple(p["port"] for p in r.get("ports", [])): r.get("from") for r in rules}
    assert by_port[(8000,)] is None  # the OpenAI endpoint: from anywhere
    assert by_port[()] == [{"podSelector": {"matchLabels": selector}}]  # Ray inside the release
    dashboard = [peer for r in rules if [p["port"] for p in r.get("ports", [])] == [8265] for peer in r["from"]]
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    assert dashboard == [{"podSelector": {}}, operator]  # this namespace, and the KubeRay operator
    restricted = the(render(None, "networkPolicy.serveFrom[0].podSelector.matchLabels.role=client"), "NetworkPolicy")
    serve_rule = next(r for r in restricted["spec"]["ingress"] if [p["port"] for p in r.get("ports", [])] == [8000])
    assert serve_rule["from"] == [{"podSelector": {"matchLabels": {"role": "client"}}}]
    assert not of_kind(render(None, "networkPolicy.enabled=false"), "NetworkPolicy")


def test_api_key_secret_reaches_every_ray_container():
    """The ingress, which checks the key, may run on any pod."""
    service = rayservice(None, "apiKeySecret.name=keys")
    env = {"name": "SPLITSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}}
    for template in pod_templates(service).values():
        assert env in template["spec"]["containers"][0]["env"]
    assert "SPLITSERVE_API_KEY" not in str(rayservice())


def test_ray_auth_secret_is_the_one_kuberay_uses():
    manifests = render()
    auth = the(manifests, "RayService")["spec"]["rayClusterConfig"]["authOptions"]
    secret = the(manifests, "Secret")
    assert auth == {"mode": "token", "secretName": secret["metadata"]["name"]}
    assert len(secret["data"]["auth_token"]) >= 32
    mine = render(None, "rayAuth.existingSecret=mine")
    assert not of_kind(mine, "Secret")
    assert the(mine, "RayService")["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "mine"


# --- values the chart refuses --------------------------------------------------------------------

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
], ids=["no-model", "two-models", "pvc-without-path", "tp-not-dividing-1-gpu", "tp-not-dividing-8-gpus",
        "tp-0", "tp-negative", "tp-fractional", "prompt-without-token", "no-gpus", "fractional-cpus",
        "cpus-per-worker-renamed", "pools-in-cluster"])
def test_refuses(sets, message):
    assert message in render_error(None, *sets)


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


# --- observability ---------------------------------------------------------------------------------

def test_monitors_scrape_the_head_serve_port_when_asked():
    assert not of_kind(render(), "ServiceMonitor") and not of_kind(render(), "PodMonitor")
    manifests = render(None, *MONITORS)
    service = the(manifests, "RayService")
    serve_service = service["spec"]["serveService"]
    head = pod_templates(service)["head"]
    head_ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert head_ports["serve"] == 8000 == serve_service["spec"]["ports"][0]["port"]
    assert serve_service["spec"]["ports"][0]["name"] == "serve"  # KubeRay's Serve Service needs this name
    monitor = the(manifests, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= serve_service["metadata"]["labels"].items()
    keep = monitor["spec"]["endpoints"][0]["relabelings"][0]
    assert keep["action"] == "keep" and keep["regex"] == head["metadata"]["labels"]["app.kubernetes.io/component"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    pod_monitor = the(manifests, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= head["metadata"]["labels"].items()
    for template in pod_templates(service).values():  # the head alone: one target per cluster
        if template is not head:
            assert not pod_monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    for found in (monitor, pod_monitor):
        assert found["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    labelled = render(None, *MONITORS, "monitoring.serviceMonitor.labels.release=prom")
    assert the(labelled, "ServiceMonitor")["metadata"]["labels"]["release"] == "prom"


def test_dashboard_configmap_for_the_grafana_sidecar():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "splitserve.json").read_text())
    configmap = the(render(), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["splitserve.json"]) == dashboard
    relabelled = render(None, "grafana.dashboard.label=dashboards", "grafana.dashboard.labelValue=yes")
    assert the(relabelled, "ConfigMap")["metadata"]["labels"]["dashboards"] == "yes"
    assert not of_kind(render(None, "grafana.dashboard.enabled=false"), "ConfigMap")


def test_the_chart_dashboard_is_a_copy_of_deploy_grafana():
    """The chart reads its own copy (helm packages only the chart's directory): edit both."""
    original = ROOT / "deploy" / "grafana" / "splitserve.json"
    copy = CHART / "dashboards" / "splitserve.json"
    assert copy.read_bytes() == original.read_bytes(), f"cp {original.relative_to(ROOT)} {copy.relative_to(ROOT)}"


def test_notes_tell_how_to_call_benchmark_and_watch(tmp_path: Path):
    notes = render_notes(tmp_path, None, "apiKeySecret.name=keys")
    assert "kubectl -n serving port-forward svc/splitserve-serve-svc 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/completions" in notes and "OpenAI(base_url=" in notes
    assert "get secret keys" in notes and "--api-key" in notes
    assert "port-forward svc/splitserve-head-svc 8265:8265" in notes
    assert "export RAY_AUTH_MODE=token" in notes and "get secret splitserve-ray-auth" in notes
    assert re.search(r"ray job submit --address http://127\.0\.0\.1:8265 -- \\\n\s+python -m splitserve\.bench "
                     r"--url http://splitserve-serve-svc:8000", notes)
    assert "--out /results/" in notes
    assert "ConfigMap splitserve-dashboard" in notes and "grafana_dashboard=1" in notes


def test_notes_count_each_pool_s_workers_at_its_tensor_parallel_size(tmp_path: Path):
    notes = render_notes(tmp_path, "values-splitwise-hh.yaml", "pools.token.tensorParallelSize=2")
    assert "prompt pool: 1 workers of 8 GPU(s) each (tensor parallel) on 1 pods x 8 GPUs, hardware class h100" in notes
    assert "token pool: 4 workers of 2 GPU(s) each (tensor parallel) on 1 pods x 8 GPUs, hardware class h100" in notes
    assert "prompt pool: 1 workers of 1 GPU(s) each on 1 pods x 1 GPUs" in render_notes(tmp_path / "defaults")
