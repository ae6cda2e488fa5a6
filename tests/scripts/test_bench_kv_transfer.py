"""The KV-transfer benchmark runs end to end (a pair of worker processes per backend: gloo, and
shared memory), writes its rows, and stops its workers cleanly; a windowed model's windowed layers
send only what the token worker's window reaches."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kv_transfer.py"
KEYS = {"prompt_tokens", "kv_bytes", "sent_bytes", "prefill_ms", "serialized_transfer_ms", "visible_transfer_ms",
        "second_token_overhead"}


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "kv.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], check=True,
                          capture_output=True, text=True, timeout=300)
    assert "worker exited with code" not in done.stderr  # each one stopped cleanly
    rows = json.loads(out.read_text())
    assert [(r["model"], r["backend"], r["prompt_tokens"]) for r in rows] == [
        ("demo", "gloo", 128), ("demo", "ipc", 128), ("demo", "gloo", 600), ("demo", "ipc", 600),
        ("windowed 128 (dummy)", "gloo", 600), ("windowed 128 (dummy)", "ipc", 600)]
    for row in rows:
        assert KEYS <= set(row)
        assert row["prefill_ms"] > 0 and row["serialized_transfer_ms"] > 0 and row["visible_transfer_ms"] > 0
        if row["model"] == "demo":  # 4 layers, 4 kv heads, dim 32, fp32: every position travels
            assert row["sent_bytes"] == row["kv_bytes"] == row["prompt_tokens"] * 2 * 4 * 4 * 32 * 4
        else:  # 8 layers of 4 kv heads, dim 64: the full one whole, the 7 windowed from block (600 - 127) // 16
            per_layer_token = 2 * 4 * 64 * 4
            assert row["kv_bytes"] == 600 * 8 * per_layer_token
            assert row["sent_bytes"] == (600 + 7 * (600 - 473 // 16 * 16)) * per_layer_token
