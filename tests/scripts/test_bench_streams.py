"""The streaming benchmark: its CPU accounting by process title on hand-made readings, and a tiny
run end to end (its own local Ray, in a subprocess) that reports every column."""
import pytest

from tests.scripts.script_runner import load_script, run_ray_script

bench_streams = load_script("bench_streams")


def test_cpu_is_counted_per_role_for_processes_alive_across_the_window():
    before = {1: ("ray::Worker", 10.0), 2: ("ray::ServeReplica:streams:Ingress", 3.0), 3: ("ray::ProxyActor", 1.0),
              4: ("ray::Controller", 5.0)}
    after = {1: ("ray::Worker.feed", 12.5), 2: ("ray::ServeReplica:streams:Ingress", 4.0), 3: ("ray::ProxyActor", 1.5),
             4: ("ray::Controller", 9.0), 5: ("ray::Worker", 50.0)}  # 5 started inside the window
    assert bench_streams.cpu_by_role(before, after) == {"token worker": 2.5, "ingress": 1.0, "proxy": 0.5}


@pytest.mark.serial  # its own local Ray
def test_tiny_run_reports_every_column(tmp_path):
    done, result = run_ray_script("bench_streams", tmp_path, "--concurrency", "2", "--max-tokens", "4", "--rounds", "1",
                                  "--port", "8027", timeout=400)
    [row] = result["rows"]
    assert row["engine_tokens_per_s"] > 0 and row["cluster_tokens_per_s"] > 0 and row["ratio"] > 0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 <= row["gap_p50_ms"] <= row["gap_p99_ms"]
    assert set(row["cpu_s_per_1k_tokens"]) == {"token worker", "ingress", "proxy"}
    assert "median ratio" in done.stdout
