"""The worker pods' Triton kernel cache (values `compileCache`): every worker container points
Triton's own cache setting into a volume of the pod, an emptyDir or the release's claim."""
from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from tests.deploy.helm_helpers import ids, pod_templates, rayservice


def cache_dir_and_volume(template: dict) -> tuple[str, dict] | None:
    """The worker container's TRITON_CACHE_DIR and the volume mounted above it, or None."""
    container = template["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if "TRITON_CACHE_DIR" not in env:
        return None
    path = PurePosixPath(env["TRITON_CACHE_DIR"])
    mounts = [m for m in container.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    assert len(mounts) == 1 and not mounts[0].get("readOnly"), f"{path} is not in one writable mount: {mounts}"
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    return str(path), volumes[mounts[0]["name"]]


@ids
def test_every_worker_keeps_its_kernels_in_an_empty_dir_by_default(preset):
    templates = pod_templates(rayservice(preset))
    assert cache_dir_and_volume(templates.pop("head")) is None  # the head runs no engine
    assert templates
    for name, template in templates.items():
        found = cache_dir_and_volume(template)
        assert found is not None, f"{name} has no TRITON_CACHE_DIR"
        assert "emptyDir" in found[1], name


@pytest.mark.parametrize("preset, sets", [("values-splitwise-ha.yaml", ()),
                                          (None, ("model.demo=false", "model.pvc.claimName=weights",
                                                  "model.pvc.path=llama", "apiKeySecret.name=keys"))],
                         ids=["splitwise-ha", "model-claim-and-api-key"])
def test_a_claim_is_shared_by_every_worker_pod(preset, sets):
    service = rayservice(preset, "compileCache.claimName=kernels", *sets)
    templates = pod_templates(service)
    templates.pop("head")
    for name, template in templates.items():
        _, volume = cache_dir_and_volume(template)
        assert volume["persistentVolumeClaim"] == {"claimName": "kernels"}, name
        if sets:  # the other mounts and variables are still there
            container = template["spec"]["containers"][0]
            assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
            assert "SPLITSERVE_API_KEY" in {e["name"] for e in container["env"]}


def test_triton_reads_the_variable_the_chart_sets(monkeypatch, tmp_path):
    """The variable the chart points into the cache volume is the one Triton's file cache takes
    its directory from."""
    from triton.runtime.cache import FileCacheManager

    container = pod_templates(rayservice())["prompt"]["spec"]["containers"][0]
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "compile-cache")
    names = [e["name"] for e in container["env"] if PurePosixPath(e.get("value", "/")).is_relative_to(mount)]
    assert len(names) == 1, names
    monkeypatch.setenv(names[0], str(tmp_path))
    assert PurePosixPath(FileCacheManager("some-kernel-hash").cache_dir).parent == PurePosixPath(tmp_path)
