"""bench_moe.py: the tiny layer runs end to end on the CPU (Triton's interpreter), every format per
token count (the quantized ones every way: as read, dequantized first and, FP8, W8A8), each
quantized output equal to its weights dequantized within half precision (W8A8 within its
activations' e4m3 rounding), and the bytes it counts are the experts' own: 2 bytes a weight dense,
half a byte and a scale per 32 as MXFP4, a byte and a float32 scale per 128 x 128 block as FP8, half
a byte and a float32 scale and 4-bit zero point a row's group of 128 (the tiny layer's rows, 64) as
packed integers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe.py"


def test_the_tiny_layer_runs_every_format_and_path_and_counts_their_bytes(tmp_path):
    """At 64 tokens (32 assignments an expert) the MXFP4 experts are dequantized first and the FP8
    and integer ones are read as stored (the CPU has no FP8 tensor cores, and 32 is below their
    threshold); each quantized format also runs the other ways, their rows marked as not taken."""
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--tokens", "1,64", "--iters", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = {(r["tokens"], r["format"], r["path"]): r for r in result["rows"]}
    assert result["device"] == "cpu" and (result["experts"], result["top_k"], result["hidden"]) == (4, 2, 64)
    mxfp4 = {1: ["as read", "dequantized"], 64: ["dequantized", "as read"]}
    assert list(rows) == [(t, f, path) for t in (1, 64) for f, path in
                          [("dense", "as read")] + [("mxfp4", path) for path in mxfp4[t]] +
                          [("fp8", "as read"), ("fp8", "dequantized"), ("fp8", "w8a8"), ("int", "as read"),
                           ("int", "dequantized")]]
    assert [r["default"] for r in rows.values()] == [True, True, False, True, False, False, True, False] * 2
    assert rows[1, "dense", "as read"]["experts_hit"] == 2 and rows[64, "dense", "as read"]["experts_hit"] == 4
    weights = 4 * 3 * 64 * 64  # experts x (gate, up, down) x hidden x width
    biases, rows_in_out = 4 * (2 * 64 + 64) * 2, 2 * 64 * 64 * 2  # gate/up and down biases; x and out, float16
    assert rows[64, "dense", "as read"]["bytes"] == 2 * weights + biases + rows_in_out
    for path in ("as read", "dequantized"):
        assert rows[64, "mxfp4", path]["bytes"] == weights // 2 + weights // 32 + biases + rows_in_out
    for path in ("as read", "dequantized", "w8a8"):
        assert rows[64, "fp8", path]["bytes"] == weights + 4 * 2 * 4 + biases + rows_in_out  # a block of w13, w2
    scales, zeros = 4 * (128 + 64) * 4, 4 * (128 + 64) // 8 * 4  # a group a row of w13 and w2; zeros 8 a word
    for path in ("as read", "dequantized"):
        assert rows[64, "int", path]["bytes"] == weights // 2 + scales + zeros + biases + rows_in_out
    assert rows[1, "dense", "as read"]["bytes"] == (2 * weights + biases) // 2 + 2 * 64 * 2  # half the experts
    for (_, fmt, path), r in rows.items():
        if fmt != "dense":
            assert r["speedup_vs_dense"] > 0
            if path == "w8a8":
                assert 1e-3 < r["max_rel_diff"] < 0.1
            else:  # dequantized first: the dense kernels on the same weights
                assert r["max_rel_diff"] < 1e-2 and (r["max_rel_diff"] == 0 or path == "as read")
    assert all(r["step_ms"] > 0 and r["mbu"] is None for r in rows.values())  # no peak for a CPU


def test_a_dense_shape_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "llama3-8b"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "invalid choice: 'llama3-8b'" in done.stderr
