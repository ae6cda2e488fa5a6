"""bench_penalties.py: a small batch runs end to end on the CPU, both ways, to the same logits; a
device it cannot name is refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_penalties.py"


def test_kept_and_fresh_counts_give_the_same_logits(tmp_path):
    out = tmp_path / "penalties.json"
    subprocess.run([sys.executable, str(SCRIPT), "--iters", "3", "--batches", "1,5", "--contexts", "40,300",
                    "--vocab", "500", "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["vocab"] == 500
    rows = result["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(b, c) for c in (40, 300) for b in (1, 5)]
    assert all(r["equal"] and r["speedup"] == pytest.approx(r["fresh_ms"] / r["kept_ms"]) for r in rows)


def test_an_unknown_device_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "tpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--device takes cpu or cuda" in done.stderr
