"""The ingress benchmark runs end to end (its own local Ray, in a subprocess) and reports every path."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ingress.py"


@pytest.mark.serial  # its own local Ray
def test_tiny_run_reports_every_path(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ingress.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "3", "--port", "8019", "--json", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rows"]] == ["engine", "serve-floor", "mixed", "split"]
    assert all(r["requests"] == 3 and 0 < r["p50_ms"] <= r["p99_ms"] for r in result["rows"])
    assert 0 < result["place_p50_ms"] <= result["place_p99_ms"]
    assert "| split |" in done.stdout
