"""bench_sliding_window_kv.py end to end on a tiny workload: the same blocks run more sequences at
once when a window's blocks are kept, and when prompts take theirs chunk by chunk; the two layouts'
greedy tokens are equal (the script checks), and every number is reported."""
import json

import pytest

from tests.scripts.script_runner import run_script


@pytest.mark.parametrize("layers,groups", [("every", 1), ("alternate", 2)])
def test_a_tiny_run_reports_both_layouts(tmp_path, layers, groups):
    out = tmp_path / "window.json"
    done = run_script("bench_sliding_window_kv", "--requests", "8", "--prompt-len", "32", "--output-len", "64",
                      "--fit", "2", "--window", "16", "--layers", layers, "--repeats", "1", "--threads", "1",
                      "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    window, whole = result["layouts"]["window"], result["layouts"]["whole"]
    blocks = 2 * groups * 6 + 1  # two sequences of 96 tokens, a block of each layer group's a 16-token block
    assert window["kv_blocks"] == whole["kv_blocks"] == blocks and result["window"] == 16
    assert window["mean_running"]["median"] > whole["mean_running"]["median"]
    assert window["preemptions"]["median"] < whole["preemptions"]["median"]
    assert window["steps"]["median"] < whole["steps"]["median"] and result["throughput_ratio_window_vs_whole"] > 0
    assert f"| window | {blocks} |" in done.stdout and "greedy tokens equal" in done.stdout


def test_prompts_taken_chunk_by_chunk_let_more_sequences_run(tmp_path):
    """Against prompts taking every block at admission: where the cache binds, more sequences run
    at once and the work takes fewer steps (the counts do not depend on timing)."""
    out = tmp_path / "prompts.json"
    done = run_script("bench_sliding_window_kv", "--against", "prompts-whole", "--requests", "12", "--prompt-len",
                      "256", "--output-len", "128", "--window", "64", "--chunk", "32", "--fit", "2", "--repeats", "1",
                      "--threads", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    window, whole = result["layouts"]["window"], result["layouts"]["prompts-whole"]
    assert window["peak_running"] > whole["peak_running"] and window["steps"]["median"] < whole["steps"]["median"]
    assert result["throughput_ratio_window_vs_prompts_whole"] > 0 and window["ttft_p90_s"]["median"] > 0
    assert "| prompts-whole | 49 |" in done.stdout and "chunks of 32 tokens" in done.stdout


def test_a_model_without_a_window_everywhere_is_refused(tmp_path):
    from splitserve.engine.demo import DEMO_MODEL_CONFIG
    from splitserve.engine.dummy_weights import write_shape_checkpoint

    plain = write_shape_checkpoint(tmp_path / "llama", DEMO_MODEL_CONFIG)
    done = run_script("bench_sliding_window_kv", "--model", plain, "--requests", "2", "--repeats", "1", timeout=120)
    assert done.returncode != 0 and "no layer group has a sliding window" in done.stderr
