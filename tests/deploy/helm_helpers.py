"""Rendering helm/splitserve with a real helm and checking what it renders against the schemas
Kubernetes and KubeRay publish: core kinds through kubernetes-validate (Kubernetes' OpenAPI
schemas), the RayService through the openAPIV3Schema of KubeRay's CRD (crds/, copied from
KubeRay). helm comes from `bash scripts/install_test_tools.sh` (.tools/bin/helm), $HELM or PATH.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitserve.config import APP_IMPORT_PATH, ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "splitserve"
PRESETS = ("values-splitwise-ha.yaml", "values-splitwise-hhcap.yaml", "values-splitwise-hh.yaml",
           "values-baseline.yaml")
CRD = Path(__file__).resolve().parent / "crds" / "ray.io_rayservices.yaml"
KUBERNETES_VERSION = "1.30"  # the oldest Kubernetes still supported upstream when this was written
RELEASE = "splitserve"


def helm_binary() -> str:
    """The helm to test with; a missing helm fails the test (CI installs it through the README)."""
    for candidate in (os.environ.get("HELM"), str(ROOT / ".tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("helm not found: run `bash scripts/install_test_tools.sh` (installs helm 3.6 into .tools/), "
                "or point $HELM at a helm binary", pytrace=False)


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)


def value_args(preset: str | None = None, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["-f", str(CHART / preset)] if preset else []
    for assignment in sets:
        args += ["--set", assignment]
    return args


@functools.cache
def _template(preset: str | None, sets: tuple[str, ...], chart: str) -> tuple[dict, ...]:
    result = run_helm("template", RELEASE, chart, "--namespace", "serving", *value_args(preset, sets))
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(preset: str | None = None, *sets: str) -> list[dict]:
    """The manifests `helm template` renders with a preset (None: the defaults) and --set values."""
    return copy.deepcopy(list(_template(preset, tuple(sets), str(CHART))))


def render_error(preset: str | None = None, *sets: str) -> str:
    """helm template's error output for values the chart must refuse."""
    result = run_helm("template", RELEASE, str(CHART), *value_args(preset, sets))
    assert result.returncode != 0, "helm template rendered values it should have refused"
    return result.stderr


def render_notes(tmp_path: Path, preset: str | None = None, *sets: str) -> str:
    """NOTES.txt as helm shows it after an install. `helm template` skips NOTES.txt and `helm
    install --dry-run` needs a cluster in helm 3.6, so a copy of the chart renders it as a named
    template inside a ConfigMap."""
    chart = tmp_path / "splitserve"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + notes + "\n{{- end -}}\n")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n"
        '  notes: |\n    {{- include "notes" . | nindent 4 }}\n')
    manifests = _template(preset, tuple(sets), str(chart))
    return next(m for m in manifests if m["metadata"]["name"] == "notes")["data"]["notes"]


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def the(manifests: list[dict], kind: str) -> dict:
    found = of_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """Group name ('head' for the head group) -> that group's pod template."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _forbid_unknown_fields(schema):
    """The API server prunes fields a structural schema does not name, silently: a misspelled
    field would vanish at install. Validation here rejects them instead."""
    if isinstance(schema, dict):
        schema = {key: _forbid_unknown_fields(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_forbid_unknown_fields(item) for item in schema]
    return schema


@functools.lru_cache(maxsize=1)
def _rayservice_validator() -> jsonschema.Draft7Validator:
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_forbid_unknown_fields(version["schema"]["openAPIV3Schema"]))


def validate_rayservice(manifest: dict) -> None:
    assert manifest["apiVersion"] == "ray.io/v1"
    errors = sorted(_rayservice_validator().iter_errors(manifest), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def validate_core(manifest: dict) -> None:
    """A core Kubernetes kind against Kubernetes' own schema, unknown fields refused."""
    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(map(str, error.path))
        raise AssertionError(f"{manifest['kind']} {manifest['metadata']['name']}: {path}: {error.message}") from None


# ---- the rendered RayService and the cluster it deploys -------------------------------------------
ALL = (None, *PRESETS)  # None: the chart's defaults
ids = pytest.mark.parametrize("preset", ALL, ids=lambda p: p or "defaults")
MONITORS = ("monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true")


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
