"""The design comparison runs end to end (its own local Ray, in a subprocess) and writes one row
per design and rate with the fields the README table and issue ask for."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_designs.py"


@pytest.mark.serial  # its own local Ray
def test_tiny_comparison_writes_every_row(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "compare.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-requests", "4", "--rates", "2,4", "--length-scale",
                           "0.05", "--port", "8023", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["design"], r["rate"]) for r in rows] == [(d, r) for d in ("baseline", "sarathi", "splitwise")
                                                        for r in (2.0, 4.0)]
    for row in rows:
        assert row["num_requests"] == 4 and row["num_failed"] == 0 and row["throughput_rps"] > 0
        assert all(0 < row[m]["p50"] <= row[m]["p99"] for m in ("ttft_s", "tbt_s", "e2e_s"))
    assert "| 4 | splitwise |" in done.stdout


@pytest.mark.serial  # its own local Ray
def test_tiny_capacity_search_writes_measured_and_simulated(tmp_path):
    """A small engine profile, measured here, and the overhead fitted on one run of each point:
    with SLOs nothing misses, the search ends at the top rate whatever they come to."""
    pytest.importorskip("ray")
    from splitserve.sim.profile import ProfileSpec, run_profile, write_csv

    spec = ProfileSpec("demo", "cpu", repeats=1, prompt_sizes=(32, 128, 512), batch_sizes=(1, 2, 4))
    profile = write_csv(run_profile(spec).rows, tmp_path / "engine.csv")
    out = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--capacity", "--designs", "splitwise", "--rate-low", "1",
                           "--rate-high", "2", "--iterations", "0", "--capacity-duration", "2", "--min-requests", "2",
                           "--tbt-slo", "60", "--ttft-slo", "60", "--length-scale", "0.05", "--port", "8024",
                           "--engine-profile", str(profile), "--overhead-repeats", "1",
                           "--no-progress", "--json", str(out), "--out", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["engine_profile_csv"] == profile.read_text()  # the given profile, not one measured anew
    (row,) = saved["rows"]
    assert row["design"] == "splitwise" and row["capacity_rps"] == row["simulated_capacity_rps"] == 2.0
    assert [p["rate"] for p in row["probes"]] == [p["rate"] for p in row["simulated_probes"]] == [1.0, 2.0]
    assert row["overhead"]["request_s"] > 0
    assert "| splitwise | 2.00 | 2.00 | 1.00 | 2 |" in done.stdout
    assert (tmp_path / "plots" / "capacity_latency_vs_load.png").read_bytes()[:4] == b"\x89PNG"
    again = tmp_path / "again.json"  # the simulated searches alone, from the saved result
    done = subprocess.run([sys.executable, str(SCRIPT), "--resimulate", str(out), "--json", str(again)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (rerun,) = json.loads(again.read_text())["rows"]
    assert rerun["probes"] == row["probes"] and rerun["simulated_probes"] == row["simulated_probes"]
    assert "| splitwise | 2.00 | 2.00 | 1.00 | 2 |" in done.stdout
    out.write_text(out.read_text().replace('"engine_profile_csv"', '"profile"'))
    done = subprocess.run([sys.executable, str(SCRIPT), "--resimulate", str(out)], capture_output=True, text=True)
    assert done.returncode != 0 and "missing engine_profile_csv" in done.stderr
