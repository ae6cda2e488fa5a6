"""The helm chart (helm/splitserve) as helm 3.6 renders it, with its defaults and every preset:
lint, and every manifest against its schema (Kubernetes' OpenAPI schemas via kubernetes-validate,
KubeRay's RayService CRD in crds/). helm: `bash scripts/install_test_tools.sh`.
"""
from __future__ import annotations

import re

import pytest

from tests.deploy.helm_helpers import (
    ALL,
    CHART,
    MONITORS,
    helm_binary,
    ids,
    rayservice,
    render,
    run_helm,
    the,
    validate_core,
    validate_rayservice,
    value_args,
)


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
           "head.resultsClaimName=results", "head.batchesClaimName=batches", "imagePullSecrets[0].name=registry",
           "rayAuth.existingSecret=token", "networkPolicy.serveFrom[0].namespaceSelector.matchLabels.team=ml",
           "pools.prompt.acceleratorType=H100", "compileCache.claimName=kernels")


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
