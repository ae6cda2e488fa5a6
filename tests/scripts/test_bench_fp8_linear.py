"""bench_fp8_linear.py: the tiny projections run end to end on the CPU (Triton's interpreter), bf16
and FP8 per projection and token count, each FP8 output equal to its codes dequantized within half
precision, and the bytes it counts are the weights' own: 2 a value in bf16, a code a value and a
float32 scale per 32 x 32 block as FP8."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_fp8_linear.py"


def test_the_tiny_projections_run_both_formats_and_count_their_bytes(tmp_path):
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--tokens", "1,32", "--iters", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = {(r["tokens"], r["projection"], r["format"]): r for r in result["rows"]}
    assert result["device"] == "cpu" and result["block"] == [32, 32] and len(rows) == 2 * 5 * 2
    shapes = {"qkv": (256, 128), "o_proj": (128, 128), "gate_up": (512, 128), "down": (128, 256)}  # [out, in]
    for name, (n, k) in shapes.items():
        rows_in_out = 32 * (k + n) * 2  # x and out, float16
        assert rows[32, name, "bf16"]["bytes"] == 2 * n * k + rows_in_out
        assert rows[32, name, "fp8"]["bytes"] == n * k + 4 * (n // 32) * (k // 32) + rows_in_out
        assert rows[32, name, "fp8"]["flops"] == 2 * 32 * n * k
        assert rows[32, name, "fp8"]["max_rel_diff"] < 1e-2 and rows[1, name, "fp8"]["max_rel_diff"] < 1e-2
    for fmt in ("bf16", "fp8"):
        layer = rows[32, "layer", fmt]
        assert layer["bytes"] == sum(rows[32, name, fmt]["bytes"] for name in shapes)
        assert layer["step_ms"] == pytest.approx(sum(rows[32, name, fmt]["step_ms"] for name in shapes))
    assert all(r["step_ms"] > 0 and r["mbu"] is None for r in result["rows"])  # no peak for a CPU


def test_one_scale_a_row_counts_a_float32_scale_a_row(tmp_path):
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--scales", "row", "--tokens", "1", "--iters", "1",
                    "--json", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = {r["projection"]: r for r in result["rows"] if r["format"] == "fp8"}
    assert result["scales"] == "row" and rows["down"]["bytes"] == 128 * 256 + 4 * 128 + (256 + 128) * 2
    assert all(r["max_rel_diff"] < 1e-2 for name, r in rows.items() if name != "layer")


def test_an_moe_shape_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "qwen3-30b-a3b"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "invalid choice: 'qwen3-30b-a3b'" in done.stderr
