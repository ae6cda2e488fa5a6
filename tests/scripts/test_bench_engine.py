"""The engine benchmark runs end to end and writes the JSON its README numbers come from."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_engine.py"


def test_quick_run_writes_every_result(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--num-requests", "4",
                    "--in-flight", "1,2", "--repeats", "1", "--latency-output-len", "4", "--decode-batches", "1,2",
                    "--decode-steps", "2", "--prefill-lens", "16,64", "--char-repeats", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["throughput_ratio_vs_hf"] > 0 and result["single_request_latency_ratio_vs_hf"] > 0
    assert set(result["throughput"]) == {"1", "2"}
    assert all(r["greedy_outputs_identical"] == "4/4" for r in result["throughput"].values())
    assert result["single_request_latency"]["greedy_tokens_identical"] == "4/4"
    assert set(result["decode_step_ms_by_batch"]) == {"1", "2"}
    assert set(result["prefill_ms_by_prompt_len"]) == {"16", "64"}


def test_engine_only_runs_no_transformers_side(tmp_path):
    out = tmp_path / "engine.json"
    subprocess.run([sys.executable, str(SCRIPT), "--engine-only", "--threads", "1", "--decode-batches", "1,3",
                    "--decode-context", "40", "--decode-steps", "2", "--prefill-lens", "16", "--char-repeats", "1",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert "throughput" not in result and "single_request_latency" not in result
    assert set(result["decode_step_ms_by_batch"]) == {"1", "3"} and set(result["prefill_ms_by_prompt_len"]) == {"16"}
    assert all(r["median"] > 0 for r in result["decode_step_ms_by_batch"].values())
