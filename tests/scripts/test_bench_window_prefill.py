"""bench_window_prefill.py end to end on a short prompt: every case is timed at every length, the
two windowed cases sample the same first token (the script checks), and the table is printed."""
import json

from tests.scripts.script_runner import run_script


def test_a_tiny_run_times_every_case(tmp_path):
    out = tmp_path / "prefill.json"
    done = run_script("bench_window_prefill", "--lens", "300,600", "--window", "64", "--repeats", "1",
                      "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["case"], r["prompt_tokens"]) for r in rows] == [
        (case, n) for n in (300, 600) for case in ("tiles", "one band", "no window")]
    assert all(r["min_ms"] <= r["prefill_ms"] <= r["max_ms"] and r["window"] == 64 for r in rows)
    assert "| tiles | 600 |" in done.stdout and "| no window | 600 |" in done.stdout


def test_bad_arguments_are_refused():
    done = run_script("bench_window_prefill", "--window", "0", timeout=60)
    assert done.returncode != 0 and "--window" in done.stderr
