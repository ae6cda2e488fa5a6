"""The prompt-chunk benchmark runs end to end (a worker pair per chunk size) and writes a row per
prompt and chunk size; chunked or whole, every position's KV reaches the token worker."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_prompt_chunks.py"


def test_a_smoke_run_writes_a_row_per_prompt_and_chunk_size(tmp_path):
    out = tmp_path / "chunks.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--lens", "300", "--chunks", "128", "--repeats", "1",
                           "--json", str(out)], check=True, capture_output=True, text=True, timeout=300)
    assert "worker exited with code" not in done.stderr
    rows = json.loads(out.read_text())
    assert [(r["prompt_tokens"], r["chunks"]) for r in rows] == [(300, "whole"), (300, "chunks of 128")]
    for row in rows:  # 8 layers of 4 KV heads, dim 64, fp32
        assert row["sent_bytes"] == row["kv_bytes"] == 300 * 8 * 2 * 4 * 64 * 4
        assert row["ttft_ms"] > 0 and row["serialized_transfer_ms"] > 0 and row["visible_transfer_ms"] > 0
