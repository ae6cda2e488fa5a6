"""The placement benchmark runs end to end and writes one row per policy and cluster size."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_placement.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_placement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_every_row(tmp_path, capsys):
    out = tmp_path / "placement.json"
    load_script().main(["--decisions", "30", "--workers", "4,8", "--utilization", "1.3", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["cpu"] and {(r["policy"], r["workers"]) for r in rows} == {
        (policy, size) for policy in ("round-robin", "jsq", "splitwise") for size in (4, 8)}
    for row in rows:
        assert row["decisions"] == 30 and row["reports"] > 0
        assert 0 < row["p50_us"] <= row["p99_us"] and 0 < row["report_p50_us"] <= row["report_p99_us"]
    printed = capsys.readouterr().out
    assert "CPU:" in printed and "| splitwise | 8 |" in printed


def test_requests_under_adapters_are_placed_where_the_reported_slots_hold_them(capsys):
    rows = load_script().main(["--decisions", "200", "--workers", "8", "--adapters", "4"])
    assert {r["adapters"] for r in rows} == {4} and all(r["rejected"] < 200 for r in rows)
    assert "| jsq | 8 | 4 |" in capsys.readouterr().out
