"""The simulator's speed benchmark runs both configurations end to end (a short slice of each), each in
its own process, and writes one row per run."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sim.py"


def test_a_slice_of_both_runs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sim.json"
    module.main(["--duration", "3", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [row["trace"] for row in rows] == ["code", "conversation"]
    for row in rows:
        assert row["num_requests"] == row["num_completed"] == 210
        assert row["wall_time_s"] > row["simulate_s"] > 0 and row["peak_rss_mb"] > 0
        assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p99"] and row["machine"]
    assert "| code | 35P + 5T | 210 | 1 |" in capsys.readouterr().out
