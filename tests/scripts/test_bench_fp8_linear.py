"""bench_fp8_linear.py: the tiny projections run end to end on the CPU (Triton's interpreter), bf16
and FP8 per projection and token count, each FP8 output equal to its codes dequantized within half
precision, and the bytes it counts are the weights' own: 2 a value in bf16, a code a value and a
float32 scale per 32 x 128 block (or per row) as FP8; split decode tiles timed beside unsplit ones,
and each token count's path beside the others (the tiled kernel, the weight dequantized first, W8A8)."""
import json

import pytest

from tests.scripts.script_runner import run_script

pytest.importorskip("triton")


def run_tiny(tmp_path, *args: str) -> dict:
    out = tmp_path / "fp8.json"
    done = run_script("bench_fp8_linear", "--tiny", "--iters", "1", "--json", str(out), *args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_tiny_projections_run_both_formats_and_count_their_bytes(tmp_path):
    result = run_tiny(tmp_path, "--tokens", "1,32")
    rows = {(r["tokens"], r["projection"], r["format"]): r for r in result["rows"]}
    assert result["device"] == "cpu" and result["block"] == [32, 128] and len(rows) == 2 * 5 * 4
    shapes = {"qkv": (256, 128), "o_proj": (128, 128), "gate_up": (1024, 128), "down": (128, 512)}  # [out, in]
    for name, (n, k) in shapes.items():
        rows_in_out = 32 * (k + n) * 2  # x and out, float16
        assert rows[32, name, "bf16"]["bytes"] == 2 * n * k + rows_in_out
        assert rows[32, name, "fp8"]["bytes"] == n * k + 4 * (n // 32) * (k // 128) + rows_in_out
        assert rows[32, name, "fp8"]["flops"] == 2 * 32 * n * k
        assert rows[32, name, "fp8"]["max_rel_diff"] < 1e-2 and rows[1, name, "fp8"]["max_rel_diff"] < 1e-2
    for fmt in ("bf16", "fp8"):
        layer = rows[32, "layer", fmt]
        assert layer["bytes"] == sum(rows[32, name, fmt]["bytes"] for name in shapes)
        assert layer["step_ms"] == pytest.approx(sum(rows[32, name, fmt]["step_ms"] for name in shapes))
    assert all(r["step_ms"] > 0 and r["mbu"] is None for r in result["rows"])  # no peak for a CPU


def test_each_token_count_runs_the_other_paths_beside_its_own(tmp_path):
    """Below PREFILL_TOKENS the GEMM runs tiled, with the weight dequantized first and W8A8 beside
    it; from there (a CPU has no FP8 tensor cores) dequantized, beside the others. Dequantized is the
    oracle's own product, tiled within half precision of it, W8A8 within its activations' e4m3
    rounding."""
    from splitserve.engine.model.fp8_linear import PREFILL_TOKENS

    result = run_tiny(tmp_path, "--tokens", f"1,{PREFILL_TOKENS}")
    rows = {(r["tokens"], r["projection"], r["format"]): r for r in result["rows"]}
    names = ("qkv", "o_proj", "gate_up", "down")
    for name in names:
        assert rows[1, name, "fp8"]["path"] == "tiled" and rows[1, name, "fp8"]["splits"] == 1
        assert rows[PREFILL_TOKENS, name, "fp8"]["path"] == "dequantized"
        for tokens in (1, PREFILL_TOKENS):
            assert rows[tokens, name, "fp8 w8a8"]["path"] == "w8a8" and rows[tokens, name, "fp8 w8a8"]["splits"] is None
            assert 1e-3 < rows[tokens, name, "fp8 w8a8"]["max_rel_diff"] < 0.1
        assert rows[1, name, "fp8 dequantized"]["splits"] is None
        assert rows[PREFILL_TOKENS, name, "fp8 tiled"]["splits"] == 1
        assert rows[1, name, "fp8 dequantized"]["max_rel_diff"] == 0  # the oracle's own product
        assert rows[PREFILL_TOKENS, name, "fp8"]["max_rel_diff"] == 0
        assert rows[PREFILL_TOKENS, name, "fp8 tiled"]["max_rel_diff"] < 1e-2
    assert (1, "layer", "fp8 tiled") not in rows and (PREFILL_TOKENS, "layer", "fp8 dequantized") not in rows


def test_one_scale_a_row_counts_a_float32_scale_a_row(tmp_path):
    result = run_tiny(tmp_path, "--scales", "row", "--tokens", "1")
    rows = {r["projection"]: r for r in result["rows"] if r["format"] == "fp8"}
    assert result["scales"] == "row" and rows["down"]["bytes"] == 128 * 512 + 4 * 128 + (512 + 128) * 2
    assert all(r["max_rel_diff"] < 1e-2 for name, r in rows.items() if name != "layer")


def test_split_decode_tiles_run_beside_unsplit_ones(tmp_path):
    """For 8 multiprocessors the down projection's 512 inputs split in two (the 16-row tile's
    splits read 4 k tiles of 64 at least: four times its float32 sums); every projection then also
    runs unsplit, and the layer sums those."""
    result = run_tiny(tmp_path, "--multiprocessors", "8", "--tokens", "1")
    rows = {(r["projection"], r["format"]): r for r in result["rows"]}
    assert rows["down", "fp8"]["splits"] == 2 and rows["qkv", "fp8"]["splits"] == 1
    names = ("qkv", "o_proj", "gate_up", "down")
    assert all(rows[name, "fp8 unsplit"]["splits"] == 1 for name in names)
    assert all(rows[name, fmt]["max_rel_diff"] < 1e-2 for name in names for fmt in ("fp8", "fp8 unsplit"))
    unsplit = rows["layer", "fp8 unsplit"]
    assert unsplit["step_ms"] == pytest.approx(sum(rows[name, "fp8 unsplit"]["step_ms"] for name in names))
    assert unsplit["speedup_vs_bf16"] == pytest.approx(rows["layer", "bf16"]["step_ms"] / unsplit["step_ms"])


def test_an_moe_shape_is_refused():
    done = run_script("bench_fp8_linear", "--shape", "qwen3-30b-a3b", timeout=120)
    assert done.returncode == 2 and "invalid choice: 'qwen3-30b-a3b'" in done.stderr
