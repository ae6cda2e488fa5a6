"""bench_moe.py: the tiny layer runs end to end on the CPU (Triton's interpreter), every format per
token count, each quantized output equal to its weights dequantized within half precision, and the
bytes it counts are the experts' own: 2 bytes a weight dense, half a byte and a scale per 32 as
MXFP4, a byte and a float32 scale per 128 x 128 block as FP8."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe.py"


def test_the_tiny_layer_runs_both_formats_and_counts_their_bytes(tmp_path):
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--tokens", "1,32", "--iters", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["device"] == "cpu" and (result["experts"], result["top_k"], result["hidden"]) == (4, 2, 64)
    assert [(r["format"], r["tokens"]) for r in rows] == [(f, t) for t in (1, 32) for f in ("dense", "mxfp4", "fp8")]
    assert rows[0]["experts_hit"] == 2 and rows[3]["experts_hit"] == 4  # one token: its top 2; 32 tokens: all 4
    weights = 4 * 3 * 64 * 64  # experts x (gate, up, down) x hidden x width
    biases, rows_in_out = 4 * 2 * 64 * 2, 2 * 32 * 64 * 2  # gate/up biases; x and out, float16
    assert rows[3]["bytes"] == 2 * weights + biases + rows_in_out
    assert rows[4]["bytes"] == weights // 2 + weights // 32 + biases + rows_in_out
    assert rows[5]["bytes"] == weights + 4 * 2 * 4 + biases + rows_in_out  # one block each of w13 and w2
    assert rows[0]["bytes"] == (2 * weights + biases) // 2 + 2 * 64 * 2  # half the experts, one row
    for quantized in rows[1:3] + rows[4:]:
        assert quantized["max_rel_diff"] < 1e-2 and quantized["speedup_vs_dense"] > 0
    assert all(r["step_ms"] > 0 and r["mbu"] is None for r in rows)  # no peak for a CPU


def test_a_dense_shape_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "llama3-8b"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "invalid choice: 'llama3-8b'" in done.stderr
