"""The AccelGen benchmark runs both policies on the same simulated workload and reports attainment and goodput."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_accelgen.py"


def test_tiny_run_compares_both_policies_on_one_workload(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--machines", "1", "--rates", "2", "--duration-s", "5",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["mixed", "accelgen"]
    assert rows[0]["num_requests"] == rows[1]["num_requests"] == 10
    for row in rows:
        assert 0.0 <= row["attainment"] <= 1.0
        assert row["goodput_rps"] == row["attainment"] * row["num_requests"] / 5
    assert "goodput accelgen / mixed" in done.stdout or "attains nothing" in done.stdout
