"""The actor-heap benchmark runs end to end: a row per actor, each timed with its start-up heap in
the collector's passes and frozen out of them, in a process of its own."""
import json

from tests.scripts.script_runner import load_script


def test_tiny_run_measures_every_actor_both_ways(tmp_path, capsys):
    out = tmp_path / "heaps.json"
    script = load_script("bench_actor_heaps")
    script.main(["--repeats", "1", "--logprob-tokens", "10", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["actor"] for r in rows] == list(script.ACTORS)
    for r in rows:
        assert r["objects"] > 10_000 and 0 < r["json_mb"] < 0.01  # Ray's and torch's imports; a small response
        assert r["full_pass_s_unfrozen"] > 0 and r["full_pass_s_frozen"] >= 0
        assert r["json_loads_s_unfrozen"] > 0 and r["json_loads_s_frozen"] > 0
    assert "| BatchManager |" in capsys.readouterr().out
