"""The tensor-parallel benchmark runs end to end (every rank a process, gloo) and writes its rows."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tp.py"
KV_BYTES_PER_TOKEN = 2 * 8 * 4 * 64 * 4  # the larger dummy shape: 8 layers, 4 KV heads of 64, float32


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], check=True, capture_output=True,
                   timeout=600)
    rows = json.loads(out.read_text())
    collectives, steps, transfers = rows["collectives"], rows["steps"], rows["transfers"]
    assert [r["tokens"] for r in collectives] == [1, 4, 128]  # a decode of 1 and of 4, a prefill of 128
    assert all(r["all_reduce_us"] > 0 and r["bytes"] == r["tokens"] * 512 * 4 for r in collectives)
    assert [(r["tp"], r["threads_per_rank"], r["kind"]) for r in steps] == [
        (tp, threads, kind) for tp, threads in ((1, 1), (2, 1), (1, 2)) for kind in ("prefill", "decode")]
    for row in steps:
        assert row["step_ms"] > 0
        if row["tp"] == 1:
            assert row["all_reduce_ms"] == row["control_ms"] == 0
        else:
            assert 0 < row["all_reduce_min_ms"] <= row["all_reduce_ms"] < row["step_ms"] and row["control_ms"] > 0
    assert [(r["prompt_tp"], r["token_tp"]) for r in transfers] == [(1, 1), (1, 2), (2, 1)]
    for row in transfers:
        assert row["kv_bytes"] == row["prompt_tokens"] * KV_BYTES_PER_TOKEN
        assert row["prefill_ms"] > 0 and row["serialized_transfer_ms"] > 0 and row["visible_transfer_ms"] > 0
