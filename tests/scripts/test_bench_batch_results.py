"""bench_batch_results.py: both ways complete a batch on a store in the given directory, and the
ratio is the two rates' (the rates themselves depend on the disk); bounds are refused."""
import json

import pytest

from tests.scripts.script_runner import load_script, run_script


def test_both_ways_complete_a_batch_and_the_ratio_is_theirs(tmp_path):
    bench = load_script("bench_batch_results")
    out = tmp_path / "results.json"
    assert bench.main(["--lines", "30", "--repeats", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["per result", "grouped"] and result["dir"] == str(tmp_path)
    assert all(len(r["seconds"]) == 2 and r["results_per_s"] > 0 for r in rows.values())
    assert result["speedup"] == pytest.approx(rows["grouped"]["results_per_s"] / rows["per result"]["results_per_s"])
    assert list(tmp_path.iterdir()) == [out]  # the store was temporary


def test_out_of_bounds_arguments_are_refused():
    done = run_script("bench_batch_results", "--lines", "0", timeout=120)
    assert done.returncode == 2 and "--lines takes 1 to 100000" in done.stderr
