"""bench_int_linear.py: the tiny projections run end to end on the CPU (Triton's interpreter), bf16
and packed integers per projection and token count, each packed output equal to its weights
dequantized within half precision, and the bytes it counts are the weights' own: 2 a value in bf16,
bits / 8 a value as packed words plus float32 scales and packed zero points a group of 128; each
token count's path timed beside the other, and split decode tiles beside unsplit ones."""
import json

import pytest

from tests.scripts.script_runner import run_script

pytest.importorskip("triton")


@pytest.mark.parametrize("bits", [4, 8])
def test_the_tiny_projections_run_both_formats_and_count_their_bytes(tmp_path, bits):
    out = tmp_path / "int.json"
    done = run_script("bench_int_linear", "--tiny", "--iters", "1", "--bits", str(bits), "--json", str(out),
                      "--tokens", "1,32", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["tokens"], r["projection"], r["format"]): r for r in result["rows"]}
    assert result["device"] == "cpu" and result["bits"] == bits and result["group"] == 128
    shapes = {"qkv": (256, 128), "o_proj": (128, 128), "gate_up": (1024, 128), "down": (128, 512)}  # [out, in]
    for name, (n, k) in shapes.items():
        rows_in_out = 32 * (k + n) * 2  # x and out, float16
        groups = k // 128
        assert rows[32, name, "bf16"]["bytes"] == 2 * n * k + rows_in_out
        assert rows[32, name, "int"]["bytes"] == n * k * bits // 8 + 4 * n * groups + 4 * (n * bits // 32) * groups \
            + rows_in_out
        for t in (1, 32):
            taken = rows[t, name, "int"]
            other = rows[t, name, "int dequantized" if taken["path"] == "tiled" else "int tiled"]
            assert taken["max_rel_diff"] < 1e-2 and other["max_rel_diff"] < 1e-2
    layer = rows[32, "layer", "int"]
    assert layer["bytes"] == sum(rows[32, name, "int"]["bytes"] for name in shapes)
    assert all(r["step_ms"] > 0 and r["mbu"] is None for r in result["rows"])  # no peak for a CPU


def test_split_decode_tiles_run_beside_unsplit_ones(tmp_path):
    """For 8 multiprocessors the down projection's 512 inputs split in two at 8 bits (a split reads
    at least 4 k tiles of 64: four times its 16 rows' float32 sums in words), none at 4 (8 tiles);
    every projection then also runs unsplit, and the layer sums those."""
    out = tmp_path / "int.json"
    for bits, split in ((4, 1), (8, 2)):  # the 8-bit run's rows checked on below
        done = run_script("bench_int_linear", "--tiny", "--iters", "1", "--bits", str(bits), "--multiprocessors", "8",
                          "--tokens", "1", "--json", str(out), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = {(r["projection"], r["format"]): r for r in json.loads(out.read_text())["rows"]}
        assert rows["down", "int"]["splits"] == split and rows["qkv", "int"]["splits"] == 1
        assert (("down", "int unsplit") in rows) == (split > 1)
    names = ("qkv", "o_proj", "gate_up", "down")
    assert all(rows[name, "int"]["max_rel_diff"] < 1e-2 for name in names)
    assert all(rows[name, "int unsplit"]["splits"] == 1 and rows[name, "int unsplit"]["max_rel_diff"] < 1e-2
               for name in names)
    unsplit = rows["layer", "int unsplit"]
    assert unsplit["step_ms"] == pytest.approx(sum(rows[name, "int unsplit"]["step_ms"] for name in names))
