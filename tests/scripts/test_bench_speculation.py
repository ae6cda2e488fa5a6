"""bench_speculation.py: a small run end to end on the CPU: every way gives the same tokens, the base
drafts nothing, the greedy rows draft and keep some; bad arguments are refused."""
import json

from tests.scripts.script_runner import run_script


def test_drafting_and_not_give_the_same_tokens(tmp_path):
    out = tmp_path / "spec.json"
    done = run_script("bench_speculation", "--k", "0,3", "--batches", "1,3", "--temperatures", "0,1",
                      "--prompt-tokens", "24", "--max-tokens", "24", "--repeats", "2", "--edit-every", "6",
                      "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["temperature"], r["batch"], r["prediction"], r["k"]) for r in rows] == \
        [(t, b, p, k) for t in (0.0, 1.0) for b in (1, 3) for p in ("none", "edited 1/6") for k in (0, 3)]
    assert all(r["equal"] for r in rows)
    assert all(r["drafted"] == 0 and r["acceptance"] is None and r["speedup"] == 1 for r in rows if r["k"] == 0)
    greedy = [r for r in rows if r["k"] == 3 and r["temperature"] == 0]
    assert all(r["drafted"] > 0 and r["acceptance"] > 0 and r["steps"] < 24 for r in greedy)
    predicted = [r for r in rows if r["k"] == 3 and r["prediction"] != "none"]
    assert all(0 < r["from_prediction"] < 1 and r["steps"] < 24 for r in predicted)  # the edits fail
    assert all(r["from_prediction"] is None for r in rows if r["prediction"] == "none")
    assert "| temperature | batch | prediction |" in done.stdout


def test_bad_arguments_are_refused():
    for args, message in ((["--device", "tpu"], "invalid choice: 'tpu'"), (["--k", "2,0"], "--k takes the base"),
                          (["--edit-every", "1"], "--edit-every takes 0")):
        done = run_script("bench_speculation", *args, timeout=120)
        assert done.returncode == 2 and message in done.stderr
