"""The Grafana dashboard (deploy/grafana/splitserve.json) and the Prometheus configs (deploy/prometheus/).

The dashboard must have the shape Grafana 10+ imports, query Prometheus only through its
`datasource` variable, filter every query by its `model` variable, and name only the metrics that
splitserve exports, with their types and labels: METRICS below is that contract, the list the app's
/metrics is written against. `promtool` (bash scripts/install_test_tools.sh) checks the scrape config
and parses every dashboard query with Prometheus's own parser: promtool 2.42 has no linter for a bare
PromQL expression, so each query goes in as a recording rule and `promtool check rules` parses it.
The Kubernetes monitors must scrape what the chart's own monitors scrape (`helm template`).
tests/deploy/test_prometheus_e2e.py runs the same queries against a real Prometheus server.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "splitserve.json"
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

WORKER = ("model", "worker", "pool", "hardware")
REQUEST = ("model", "lora", "kind")  # lora: the adapter a request ran under ("" for the base model); kind: generate
# or pooling (embeddings, score, rerank)
# name -> (type, label names): the metrics splitserve exports at GET /metrics.
METRICS = {
    # client-visible, measured at the ingress
    "splitserve_request_ttft_seconds": ("histogram", REQUEST),
    "splitserve_request_tbt_seconds": ("histogram", REQUEST),
    "splitserve_request_e2e_seconds": ("histogram", REQUEST),
    "splitserve_request_queue_seconds": ("histogram", ("model",)),
    "splitserve_requests_total": ("counter", (*REQUEST, "outcome")),
    "splitserve_prompt_tokens_total": ("counter", REQUEST),
    "splitserve_generation_tokens_total": ("counter", REQUEST),
    "splitserve_prompt_cached_tokens_total": ("counter", REQUEST),
    "splitserve_slo_requests_total": ("counter", (*REQUEST, "slo")),
    "splitserve_slo_met_total": ("counter", (*REQUEST, "slo")),
    "splitserve_requests_restarted_total": ("counter", REQUEST),
    "splitserve_placements_refused_total": ("counter", REQUEST),
    # per worker
    "splitserve_worker_pending_prompt_tokens": ("gauge", WORKER),
    "splitserve_worker_decode_tokens": ("gauge", WORKER),
    "splitserve_worker_running_requests": ("gauge", WORKER),
    "splitserve_worker_waiting_requests": ("gauge", WORKER),
    "splitserve_worker_kv_blocks_used": ("gauge", WORKER),
    "splitserve_worker_kv_blocks_free": ("gauge", WORKER),
    "splitserve_worker_preemptions_total": ("counter", WORKER),
    "splitserve_worker_lora_swaps_total": ("counter", ("model", "worker")),
    "splitserve_spec_decode_draft_tokens_total": ("counter", ("model", "worker")),
    "splitserve_spec_decode_accepted_tokens_total": ("counter", ("model", "worker")),
    "splitserve_worker_batch_tokens": ("histogram", WORKER),
    "splitserve_worker_step_seconds": ("histogram", (*WORKER, "phase")),
    # KV transfer (worker = the sending prompt worker)
    "splitserve_kv_transfer_bytes_total": ("counter", ("model", "worker")),
    "splitserve_kv_transfer_visible_seconds": ("histogram", ("model", "worker")),
    "splitserve_kv_transfer_overlap_ratio": ("histogram", ("model", "worker")),
    "splitserve_kv_transfer_failures_total": ("counter", ("model", "worker")),
    # prefix reuse
    "splitserve_worker_prefill_tokens_total": ("counter", ("model", "worker")),
    "splitserve_kv_import_reused_tokens_total": ("counter", ("model", "worker")),
    "splitserve_kv_host_saved_tokens_total": ("counter", ("model", "worker")),
    "splitserve_kv_host_restored_tokens_total": ("counter", ("model", "worker")),
    # pools
    "splitserve_pool_workers": ("gauge", ("model", "pool", "hardware")),
    "splitserve_pool_transitions_total": ("counter", ("model", "from_pool", "to_pool")),
    "splitserve_mixed_pool_occupancy": ("gauge", ("model",)),
    "splitserve_worker_failures_total": ("counter", ("model",)),
    "splitserve_lora_placements_total": ("counter", ("model", "slot")),
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
UNITS = {"s", "reqps", "Bps", "percentunit", "short", "suffix: tok/s"}
# Grafana's variables, replaced as Grafana would for one model over a short range.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m", "$model": "demo", "$lora": ".*",  # lora, kind: "All"
                 "$kind": ".*"}

NAME = re.compile(r"\bsplitserve_[a-z0-9_]*[a-z0-9]")
MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")

DASHBOARD = json.loads(DASHBOARD_PATH.read_text())


def all_panels(panels=None) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in DASHBOARD["panels"] if panels is None else panels:
        out.append(panel)
        out.extend(all_panels(panel.get("panels", [])))
    return out


def query_panels() -> list[dict]:
    return [p for p in all_panels() if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL with Grafana's variables) for every target on the dashboard."""
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in query_panels() for t in p["targets"]]


def concrete(expr: str) -> str:
    for variable in sorted(SUBSTITUTIONS, key=len, reverse=True):
        expr = expr.replace(variable, SUBSTITUTIONS[variable])
    return expr


def base_name(series: str) -> str:
    """The exported metric a series name belongs to (histograms expose _bucket, _sum and _count)."""
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and METRICS.get(base, ("",))[0] == "histogram":
            return base
    return series


def selectors(expr: str) -> list[tuple[str, str, str | None]]:
    """(series name, what precedes it, its {matchers} or None) for each metric selector."""
    out = []
    for match in NAME.finditer(expr):
        rest = expr[match.end():]
        matchers = rest[1:rest.index("}")] if rest.startswith("{") else None
        out.append((match.group(), expr[:match.start()], matchers))
    return out


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (it comes with Prometheus): run bash scripts/install_test_tools.sh")
    return path


# --- structure Grafana expects --------------------------------------------------------------------

def test_dashboard_is_a_grafana_10_dashboard():
    assert DASHBOARD["schemaVersion"] in (38, 39)
    assert DASHBOARD["title"] and DASHBOARD["uid"] and DASHBOARD["time"]["from"]
    assert isinstance(DASHBOARD["panels"], list) and len(query_panels()) >= 20


def test_datasource_and_model_variables():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(splitserve_requests_total, model)"
    lora = variables["lora"]  # the adapters of that model, several at once or all (the base model's have none)
    assert (lora["type"], lora["datasource"], lora["multi"], lora["includeAll"], lora["allValue"]) == \
        ("query", DATASOURCE, True, True, ".*")
    assert lora["query"]["query"] == 'label_values(splitserve_requests_total{model="$model"}, lora)'
    kind = variables["kind"]  # generate and pooling requests apart, or both
    assert (kind["type"], kind["query"], kind["multi"], kind["includeAll"], kind["allValue"]) == \
        ("custom", "generate,pooling", True, True, ".*")


def test_every_request_series_is_filtered_by_the_adapters_and_kinds_chosen():
    for where, expr in queries():
        for name, _, matchers in selectors(expr):
            if "lora" in METRICS[base_name(name)][1]:
                assert 'lora=~"$lora"' in (matchers or ""), f"{where}: {name} not filtered by $lora"
                assert 'kind=~"$kind"' in (matchers or ""), f"{where}: {name} not filtered by $kind"


def test_every_panel_and_target_uses_the_datasource_variable():
    for panel in query_panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: refIds {ref_ids}"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, f"{panel['title']} / {target['refId']}"
            assert target["expr"].strip(), f"{panel['title']} / {target['refId']}: empty query"


def test_panel_ids_are_unique():
    ids = [p["id"] for p in all_panels()]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)


def test_panels_fit_the_grid_without_overlapping():
    boxes = []
    for p in DASHBOARD["panels"]:  # panels inside collapsed rows are laid out when the row opens
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
    for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bx0, by0, bx1, by1 in boxes[i + 1:]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{a!r} overlaps {b!r}"


def test_panels_have_units():
    for panel in query_panels():
        assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, panel["title"]
    assert {p["fieldConfig"]["defaults"]["unit"] for p in query_panels()} >= {"s", "reqps", "Bps", "percentunit"}


def test_client_latencies_have_p50_p90_p99_over_rate_interval_buckets():
    exprs = [e for _, e in queries()]
    for metric in ("ttft", "tbt", "e2e"):
        for q in ("0.5", "0.9", "0.99"):
            want = (f"histogram_quantile({q}, sum by (le) (rate(splitserve_request_{metric}_seconds_bucket"
                    '{model="$model", lora=~"$lora", kind=~"$kind"}[$__rate_interval])))')
            assert want in exprs, want


# --- the queries against the metrics contract -----------------------------------------------------

def test_every_query_selects_the_model_variable():
    for where, expr in queries():
        found = selectors(expr)
        assert found, f"{where}: no splitserve metric in {expr}"
        for name, _, matchers in found:
            assert matchers is not None and 'model="$model"' in matchers, f"{where}: {name} not filtered by $model"


def test_queries_name_only_exported_metrics():
    for where, expr in queries():
        for name, _, _ in selectors(expr):
            assert base_name(name) in METRICS, f"{where}: {name} is not a splitserve metric ({expr})"


def test_the_dashboard_shows_every_exported_metric():
    shown = {base_name(name) for _, expr in queries() for name, _, _ in selectors(expr)}
    assert sorted(set(METRICS) - shown) == []


def test_counters_and_histograms_are_rated_and_gauges_are_not():
    for where, expr in queries():
        for name, before, _ in selectors(expr):
            kind = METRICS[base_name(name)][0]
            rated = before.endswith(("rate(", "increase("))
            if kind == "gauge":
                assert not rated, f"{where}: gauge {name} inside rate()/increase()"
            else:
                assert rated, f"{where}: {kind} {name} used without rate()/increase()"
            if kind == "histogram":
                assert name != base_name(name), f"{where}: histogram {name} needs _bucket, _sum or _count"


def test_the_contract_is_what_the_app_exports():
    """Each METRICS family the CLS's registry renders at start (the worker families once a worker
    has reported) has the type and labels METRICS gives it."""
    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.cluster.metrics import ClusterMetrics, SLOBounds
    from splitserve.cluster.worker_stats import WorkerStats
    from splitserve.placement.state import Role, WorkerLoad

    metrics = ClusterMetrics("demo", SLOBounds(ttft=1.0, tbt=0.1, e2e=10.0), adapters=("sql",))
    metrics.record_worker("p0", Role.PROMPT, "cpu", WorkerLoad(), WorkerStats())
    seen = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        if name in METRICS and labels:
            seen[name] = (family.type, labels)
    assert seen == {name: (kind, set(labels)) for name, (kind, labels) in METRICS.items() if name in seen}
    assert len(seen) >= 20


def test_queries_use_only_labels_the_metrics_have():
    for where, expr in queries():
        names = [name for name, _, _ in selectors(expr)]
        labels = {label for name in names for label in METRICS[base_name(name)][1]}
        if any(name.endswith("_bucket") for name in names):
            labels.add("le")
        for _, _, matchers in selectors(expr):
            for label in MATCHER_LABEL.findall(matchers or ""):
                assert label in labels, f"{where}: no label {label!r} on {names}"
        for group in GROUPING.findall(expr):
            for label in filter(None, (s.strip() for s in group.split(","))):
                assert label in labels, f"{where}: no label {label!r} on {names}"


# --- promtool -----------------------------------------------------------------------------------

def test_promtool_accepts_the_scrape_config(promtool):
    run = subprocess.run([promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
                         check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and config["global"]["scrape_interval"] == "5s"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


def test_every_dashboard_query_parses(promtool, tmp_path):
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, expr) in enumerate(queries())]
    for rule in rules:
        assert "$" not in rule["expr"], f"a Grafana variable the test does not substitute: {rule['expr']}"
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, f"{run.stdout}{run.stderr}\nqueries: {[q for q, _ in queries()]}"
    assert f"SUCCESS: {len(rules)} rules found" in run.stdout + run.stderr


@pytest.mark.parametrize("name,kind,endpoints", [("servicemonitor.yaml", "ServiceMonitor", "endpoints"),
                                                 ("podmonitor.yaml", "PodMonitor", "podMetricsEndpoints")])
def test_kubernetes_monitors_scrape_what_the_chart_scrapes(name, kind, endpoints):
    """The static monitors select, scrape and relabel as the chart's own (bar its release scoping)."""
    from tests.deploy.helm_helpers import render

    mine = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
    assert (mine["apiVersion"], mine["kind"]) == ("monitoring.coreos.com/v1", kind)
    (chart,) = [doc for doc in render(None, "monitoring.serviceMonitor.enabled=true",
                                      "monitoring.podMonitor.enabled=true") if doc["kind"] == kind]
    release_scoped = dict(chart["spec"]["selector"]["matchLabels"])
    release_scoped.pop("app.kubernetes.io/instance")
    assert mine["spec"]["selector"]["matchLabels"] == release_scoped
    (endpoint,), (expected,) = mine["spec"][endpoints], chart["spec"][endpoints]
    assert (endpoint["port"], endpoint["path"]) == (expected["port"], "/metrics")
    assert endpoint.get("relabelings") == expected.get("relabelings")  # the head pod only: one target
