"""The scoring benchmark: its pool-move count read from a /metrics text, and a tiny run end to end
(its own local Ray, in a subprocess) that answers every scoring request and reports every column."""
import pytest

from tests.scripts.script_runner import load_script, run_ray_script

bench_scoring = load_script("bench_scoring")

METRICS = """# HELP splitserve_pool_transitions_total Workers moved between pools
# TYPE splitserve_pool_transitions_total counter
splitserve_pool_transitions_total{model="demo",from_pool="token",to_pool="mixed"} 3.0
splitserve_pool_transitions_total{model="demo",from_pool="mixed",to_pool="token"} 2.0
# HELP splitserve_worker_preemptions_total Preemptions
# TYPE splitserve_worker_preemptions_total counter
splitserve_worker_preemptions_total{model="demo",worker="token-0.1"} 7.0
"""


def test_pool_moves_sum_every_transition_and_nothing_else(monkeypatch):
    monkeypatch.setattr(bench_scoring.httpx, "get", lambda url, timeout: type("R", (), {"text": METRICS})())
    assert bench_scoring.pool_moves("http://cluster") == 5.0


@pytest.mark.serial  # its own local Ray
def test_tiny_run_answers_every_scoring_request(tmp_path):
    done, result = run_ray_script("bench_scoring", tmp_path, "--requests", "4", "--concurrency", "2", "--busy", "2",
                                  "--busy-tokens", "300", "--rounds", "1", "--port", "8028", timeout=400)
    rows = result["rows"]
    assert [(r["prompt"], r["busy_streams"]) for r in rows] == [("short", 0), ("long", 0), ("short", 2), ("long", 2)]
    for row in rows:
        assert row["refused"] == 0 and row["answered_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["pool_moves"] >= 0
    assert "| long | 2 |" in done.stdout
