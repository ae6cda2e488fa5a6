"""The structured-output benchmark runs both modes on the same requests, checks the JSON, and reports the ratio."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_structured.py"


def test_tiny_run_reports_both_modes(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "6", "--in-flight", "4", "--max-tokens", "24",
                           "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["free", "json_schema"]
    assert all(r["requests"] == 6 and 0 < r["output_tokens"] <= 6 * 24 and r["tokens_per_s"] > 0 for r in rows)
    assert "json_schema / free:" in done.stdout
