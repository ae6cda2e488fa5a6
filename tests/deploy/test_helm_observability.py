"""The chart's monitoring: Prometheus Operator monitors of the head's Serve port, the Grafana
dashboard ConfigMap, and the NOTES that tell how to call, benchmark and watch."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tests.deploy.helm_helpers import (
    CHART,
    MONITORS,
    ROOT,
    of_kind,
    pod_templates,
    render,
    render_notes,
    the,
)


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
