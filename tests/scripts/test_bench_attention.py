"""bench_attention.py: the tiny layer runs end to end on the CPU (Triton's interpreter): SDPA and
each prefill configuration per prompt length, then each decode batch over a float16 cache and an
FP8 one at each count of stages, every row printed as it is measured, every kernel's output
within half precision of SDPA's on the same keys (the values FP8 codes stand for), the FLOPs of a
causal prefill and the bytes of a decode as its docstring counts them (a byte a value over FP8); a
configuration Triton cannot launch (its shared memory) is
reported and the others run; malformed configurations are refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from splitserve.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from tests.scripts.script_runner import load_script  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_attention.py"


def test_the_tiny_layer_runs_every_configuration_against_sdpa(tmp_path):
    out = tmp_path / "attention.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--iters", "1", "--tokens", "40,100",
                           "--configs", "16x16x4x3,32x16x2x5", "--decodes", "3x80,1x17", "--decode-stages", "3,5",
                           "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")] == result["rows"]
    assert [r["stages"] for r in result["rows"][6:]] == [3, 5] * 4
    rows, fives = result["rows"][:6] + result["rows"][6::2], result["rows"][7::2]  # 3 stages, 5
    assert [(r["batch"], r["context"], r["kv_cache"], r["bytes"]) for r in fives] == [
        (r["batch"], r["context"], r["kv_cache"], r["bytes"]) for r in rows[6:]]
    assert all(r["max_abs_diff_vs_sdpa"] < 1e-2 for r in fives)
    assert result["device"] == "cpu" and (result["heads"], result["kv_heads"], result["head_dim"]) == (4, 2, 16)
    assert [(r["kind"], r["kernel"], r.get("tokens"), r.get("tiles"), r.get("warps"), r.get("stages"))
            for r in rows[:6]] == [
        ("prefill", kernel, n, tiles, warps, stages) for n in (40, 100)
        for kernel, tiles, warps, stages in (("sdpa", None, None, None), ("triton", "16x16", 4, 3),
                                             ("triton", "32x16", 2, 5))]
    assert [(r["batch"], r["context"], r["kv_cache"]) for r in rows[6:]] == [
        (3, 80, "auto"), (3, 80, "fp8"), (1, 17, "auto"), (1, 17, "fp8")]
    for r in rows[:6]:
        assert r["tflops"] * 1e12 * r["ms"] / 1e3 == pytest.approx(4 * r["tokens"] * (r["tokens"] + 1) // 2 * 4 * 16)
    assert [r["bytes"] for r in rows[6:]] == [3 * 80 * 2 * 2 * 16 * 2, 3 * 80 * 2 * 2 * 16, 17 * 2 * 2 * 16 * 2,
                                              17 * 2 * 2 * 16]  # float16, e4m3 codes
    assert all(r["max_abs_diff_vs_sdpa"] < 1e-2 for r in rows if r["kernel"] == "triton")
    assert all(r["mfu" if r["kind"] == "prefill" else "mbu"] is None for r in rows)  # no peak for a CPU


def test_a_configuration_that_does_not_fit_is_reported_and_the_others_run(monkeypatch):
    bench, real = load_script("bench_attention"), TritonPagedBackend.prefill

    def prefill(self, *args, **kwargs):  # as Triton refuses a variant over a block's shared memory
        if self.prefill_stages == 7:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TritonPagedBackend, "prefill", prefill)
    rows = bench.prefill_rows(bench.TINY, [40], [(16, 16, 4, 7), (16, 16, 4, 3)], 1, torch.device("cpu"),
                              torch.float32, None)
    _, refused, ran = rows  # SDPA's, then each configuration's
    assert refused["stages"] == 7 and refused["ms"] is None and "shared memory" in refused["error"]
    assert bench._cells(refused)[4] == "does not fit"
    assert ran["stages"] == 3 and ran["ms"] > 0 and ran["max_abs_diff_vs_sdpa"] < 1e-4 and "error" not in ran


@pytest.mark.parametrize("args", [["--configs", "16x16x4"], ["--decodes", "3x0"], ["--configs", "16xax4x3"],
                                  ["--decode-stages", "3x5"], ["--decode-stages", "0"]])
def test_a_malformed_configuration_is_refused(args):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--configs takes ROWSxKEYSxWARPSxSTAGES items" in done.stderr
