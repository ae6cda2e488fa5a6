"""bench_kv_cache_dtype.py end to end on a tiny workload: the same bytes hold twice the blocks
over FP8 codes, so at least as many sequences run at once, and every number is reported."""
import json

from tests.scripts.script_runner import run_script


def test_a_tiny_run_reports_both_caches(tmp_path):
    out = tmp_path / "kv.json"
    done = run_script("bench_kv_cache_dtype", "--requests", "8", "--prompt-len", "32", "--output-len", "8", "--fit",
                      "3", "--repeats", "1", "--threads", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    auto, fp8 = result["caches"]["auto"], result["caches"]["fp8"]
    assert auto["kv_blocks"] == 3 * 3 and fp8["kv_blocks"] == 2 * auto["kv_blocks"]  # 40 tokens: 3 blocks of 16
    assert fp8["peak_running"] >= auto["peak_running"] and auto["peak_running"] < 8
    assert result["throughput_ratio_fp8_vs_auto"] > 0 and 0 < result["greedy_tokens_equal_fraction"] <= 1
    assert "| fp8 | 18 |" in done.stdout
