"""bench_sampler.py: a small vocabulary runs end to end on the CPU (Triton's interpreter), each
filter at each batch both ways, the kernel drawing the torch path's tokens; an unknown filter is
refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sampler.py"


def test_each_filter_and_batch_both_ways(tmp_path):
    out = tmp_path / "sampler.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--iters", "1", "--batches", "1,3", "--vocab", "1500",
                    "--filters", "none,top-k+top-p", "--warps", "16", "--json", str(out)], check=True,
                   capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["vocab"] == 1500 and result["warps"] == 16
    rows = result["rows"]
    assert [(r["filter"], r["batch"]) for r in rows] == [(f, b) for f in ("none", "top-k+top-p") for b in (1, 3)]
    assert all(r["tokens_differing"] == 0 for r in rows)
    assert all(r["speedup"] == pytest.approx(r["torch_ms"] / r["kernel_ms"]) for r in rows)


def test_an_unknown_filter_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--filters", "top-q"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--filters takes" in done.stderr
