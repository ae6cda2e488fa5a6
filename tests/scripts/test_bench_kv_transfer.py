"""The KV-transfer benchmark runs end to end (a pair of worker processes per backend: gloo, and
shared memory), writes its rows, and stops its workers cleanly."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kv_transfer.py"
KEYS = {"prompt_tokens", "kv_bytes", "prefill_ms", "serialized_transfer_ms", "visible_transfer_ms", "second_token_overhead"}


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "kv.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], check=True,
                          capture_output=True, text=True, timeout=300)
    assert "worker exited with code" not in done.stderr  # each one stopped cleanly
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["prompt_tokens"]) for r in rows] == [("gloo", 128), ("ipc", 128), ("gloo", 600),
                                                                   ("ipc", 600)]
    for row in rows:
        assert KEYS <= set(row)
        assert row["kv_bytes"] == row["prompt_tokens"] * 2 * 4 * 4 * 32 * 4  # demo: 4 layers, 4 kv heads, dim 32, fp32
        assert row["prefill_ms"] > 0 and row["serialized_transfer_ms"] > 0 and row["visible_transfer_ms"] > 0
