"""Every query of the Grafana dashboard against a real Prometheus scraping the test run's cluster.

A Prometheus server (the `prometheus` binary: bash scripts/install_test_tools.sh) scrapes
GET /metrics of the shared `server` app (1 prompt + 1 token worker, tests/ray_cluster.py) every
second. A short load moves the metrics: streamed completions one after another (one prompt long
enough to stream its KV layer by layer), a concurrent burst, a stream the client drops, and two bad
requests. Then every query of deploy/grafana/splitserve.json runs through Prometheus's HTTP API, with
Grafana's variables filled in, and must return data with its grouping labels set; and the counters
must agree with what the clients saw.

Series that only move on rare events (worker failures, restarts, KV transfer failures, pool moves,
preemptions, rejected requests) are exported at zero from startup, with their labels, so their
queries return data here too.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.deploy.test_grafana import NAME, SUBSTITUTIONS, concrete, queries

MODEL = SUBSTITUTIONS["$model"]  # the test cluster serves the demo model
SCRAPE_S = 1
JOB = "splitserve"
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")

# (prompt, max_tokens); "x" * 700 is past the 512-token layer-wise threshold (the byte tokenizer)
SEQUENTIAL = [("Hello, splitserve", 16), ("The disaggregated cluster says", 12), ("x" * 700, 8)] + [
    (f"Request number {i}: " + "abc " * (4 * i), 10) for i in range(9)]
BURST = [(f"Burst {i} " + "word " * (8 * i), 12) for i in range(8)]
DROPPED = ("This stream is dropped by its client after the first token", 200)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL with Grafana's variables filled in) for every dashboard target."""
    return [(where, concrete(expr)) for where, expr in queries()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Prometheus:
    url: str
    target: str
    log: Path

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus rejected {expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        """The single value of an aggregated expression; 0 when it has no series yet."""
        result = self.query(expr, at)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else 0.0

    def last_scrape(self) -> tuple[float, float] | None:
        """(start time, up) of the newest scrape of the cluster, or None before the first."""
        result = self.query(f'timestamp(up{{job="{JOB}"}})')
        if not result:
            return None
        return float(result[0]["value"][1]), float(self.query(f'up{{job="{JOB}"}}')[0]["value"][1])

    def scrape_error(self) -> str:
        targets = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return "; ".join(f"{t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in targets)

    def wait_for_scrape_after(self, moment: float, timeout: float = 30) -> float:
        """Start time of the first successful scrape that began after `moment`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            scrape = self.last_scrape()
            if scrape and scrape[0] > moment and scrape[1] == 1:
                return scrape[0]
            time.sleep(SCRAPE_S / 4)
        pytest.fail(f"Prometheus could not scrape {self.target} (is GET /metrics served?): {self.scrape_error()}\n"
                    f"Prometheus log tail:\n{self.log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory, request) -> Prometheus:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run bash scripts/install_test_tools.sh")
    work = tmp_path_factory.mktemp("prometheus")
    base = urlparse(server)
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": JOB, "metrics_path": f"{base.path.rstrip('/')}/metrics",
                                  "static_configs": [{"targets": [base.netloc]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port, log = _free_port(), work / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=out, stderr=subprocess.STDOUT)

    def stop():
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)

    request.addfinalizer(stop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            pytest.fail(f"prometheus exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"prometheus not ready after 60 s:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return Prometheus(url, f"{server}/metrics", log)


# --- the load -------------------------------------------------------------------------------------

@dataclass
class Load:
    before: float  # start of the last scrape before the load
    after: float  # start of a scrape after the load had settled
    usages: list[dict] = field(default_factory=list)  # `usage` of every completed stream


def stream_completion(base_url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == max_tokens
    return usage


def drop_stream_after_first_token(base_url: str, prompt: str, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # leaving the block closes the connection mid-stream: the request is aborted


def send_bad_requests(base_url: str) -> None:
    bad = [{"model": MODEL, "prompt": "x", "max_tokens": -1}, {"model": "no-such-model", "prompt": "x"}]
    for body in bad:
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code in (400, 404)


@pytest.fixture(scope="module")
def load(server, prometheus) -> Load:
    before = prometheus.wait_for_scrape_after(0, timeout=60)
    usages = [stream_completion(server, prompt, n) for prompt, n in SEQUENTIAL]
    with ThreadPoolExecutor(len(BURST)) as pool:
        usages += list(pool.map(lambda job: stream_completion(server, *job), BURST))
    drop_stream_after_first_token(server, *DROPPED)
    send_bad_requests(server)
    settled = time.time() + 2  # load reports and the aborted request land within this
    time.sleep(2)
    after = prometheus.wait_for_scrape_after(settled)
    prometheus.wait_for_scrape_after(after + 1.5 * SCRAPE_S)  # one more, so rates see the last samples
    return Load(before, after, usages)


# --- the tests ------------------------------------------------------------------------------------

def test_prometheus_has_every_series_the_dashboard_reads(prometheus, load):
    wanted = {name for _, expr in dashboard_queries() for name in NAME.findall(expr)}
    result = prometheus.query(f'count by (__name__) ({{__name__=~"splitserve_.+", model="{MODEL}"}})')
    missing = sorted(wanted - {series["metric"]["__name__"] for series in result})
    assert not missing, f"not exported by {prometheus.target} (model={MODEL}): {missing}"


@pytest.mark.parametrize("where,expr", dashboard_queries(), ids=[w for w, _ in dashboard_queries()])
def test_dashboard_query_returns_data(prometheus, load, where, expr):
    result = prometheus.query(expr)
    assert result, f"{where}: no data for {expr}"
    grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",")} - {"le", ""}
    for series in result:
        unset = sorted(label for label in grouped if not series["metric"].get(label))
        assert not unset, f"{where}: series {series['metric']} lacks {unset} ({expr})"


def test_counters_agree_with_what_the_clients_saw(prometheus, load):
    def moved(expr: str) -> float:
        return prometheus.value(expr, load.after) - prometheus.value(expr, load.before)

    def sel(name: str, extra: str = "") -> str:
        return f'sum({name}{{model="{MODEL}"{extra}}})'

    completed = len(load.usages)
    assert moved(sel("splitserve_requests_total", ', outcome="completed"')) == completed
    prompt_tokens = sum(u["prompt_tokens"] for u in load.usages)
    generated = sum(u["completion_tokens"] for u in load.usages)
    dropped_prompt = len(DROPPED[0].encode()) + 1  # the demo model's byte tokenizer, plus BOS
    assert prompt_tokens <= moved(sel("splitserve_prompt_tokens_total")) <= prompt_tokens + dropped_prompt + 8
    assert generated <= moved(sel("splitserve_generation_tokens_total")) <= generated + DROPPED[1]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in load.usages)
    assert cached <= moved(sel("splitserve_prompt_cached_tokens_total")) <= cached + dropped_prompt
    for histogram in ("ttft", "e2e"):  # the dropped stream had its first token and may count
        assert completed <= moved(sel(f"splitserve_request_{histogram}_seconds_count")) <= completed + 1
    assert moved(sel("splitserve_request_tbt_seconds_count")) > 0
    assert moved(sel("splitserve_kv_transfer_bytes_total")) > 0  # every request went prompt -> token worker
    for slo in ("ttft", "tbt", "e2e"):
        met = prometheus.value(sel("splitserve_slo_met_total", f', slo="{slo}"'), load.after)
        assert met <= prometheus.value(sel("splitserve_slo_requests_total", f', slo="{slo}"'), load.after), slo
    overlap = prometheus.value(f'{sel("splitserve_kv_transfer_overlap_ratio_sum")} / '
                               f'{sel("splitserve_kv_transfer_overlap_ratio_count")}', load.after)
    assert 0 <= overlap <= 1
    assert prometheus.value(sel("splitserve_pool_workers"), load.after) == 2  # 1 prompt + 1 token worker
    occupancy = prometheus.value(f'max(splitserve_mixed_pool_occupancy{{model="{MODEL}"}})', load.after)
    assert 0 <= occupancy <= 1 and not math.isnan(occupancy)


def test_metrics_follow_prometheus_conventions(server):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run bash scripts/install_test_tools.sh")
    response = httpx.get(f"{server}/metrics", timeout=30)
    assert response.status_code == 200, f"GET /metrics: {response.status_code}"
    lint = subprocess.run([promtool, "check", "metrics"], input=response.text, check=False, capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
