"""bench_windowed_imports.py end to end on a tiny workload: where every layer slides, a token
worker reserving only a window's blocks per import holds more of them at once and finishes in
fewer steps (counts that do not depend on timing); the two layouts' greedy tokens are equal (the
script checks), and every number is reported."""
import json

from tests.scripts.script_runner import run_script


def test_a_tiny_run_lands_more_imports_at_once(tmp_path):
    out = tmp_path / "imports.json"
    done = run_script("bench_windowed_imports", "--requests", "12", "--prompt-len", "512", "--output-len", "64",
                      "--window", "64", "--repeats", "1", "--threads", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    window, whole = result["layouts"]["window"], result["layouts"]["whole"]
    assert window["kv_blocks"] == whole["kv_blocks"] == 2 * 36 + 1 and result["window"] == 64
    assert window["peak_running"] == 12 > whole["peak_running"]
    assert window["steps"]["median"] < whole["steps"]["median"] and window["preemptions"]["median"] == 0
    assert result["throughput_ratio_window_vs_whole"] > 0 and window["second_token_p90_s"]["median"] > 0
    assert "| whole | 73 |" in done.stdout and "greedy tokens equal" in done.stdout


def test_bad_arguments_are_refused():
    done = run_script("bench_windowed_imports", "--prefill-steps", "0", timeout=60)
    assert done.returncode != 0 and "--prefill-steps" in done.stderr
