"""The event-loop stall benchmark runs end to end: every case both ways, the same bytes either way,
the ingress's threshold as it was afterwards, and the CLS's recording timed both ways."""
import gc
import json

from splitserve.cluster import large_bodies
from tests.scripts.script_runner import load_script


def test_tiny_run_writes_every_case_both_ways(tmp_path, capsys):
    out, threshold = tmp_path / "stalls.json", large_bodies.LOGPROB_TOKENS_ON_LOOP
    script = load_script("bench_loop_stalls")
    script.main(["--tokens", "600", "--top", "3", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    rows, cls = result["rows"], result["cls_record"]
    assert cls["tokens"] == 600 and 0 < cls["counted_ms"] and 0 < cls["each_gap_ms"]
    assert [(r["case"], r["way"]) for r in rows] == [(c, w) for c in script.CASES for w in ("thread", "loop")]
    for thread, loop in zip(rows[::2], rows[1::2]):
        assert thread["bytes"] == loop["bytes"] > 600 * 3 * 10  # every token's alternatives, either way
        for row in (thread, loop):
            assert 0 < row["p99_gap_s"] <= row["longest_gap_s"] and row["response_s"] > 0
    assert large_bodies.LOGPROB_TOKENS_ON_LOOP == threshold
    assert gc.get_freeze_count() == 0 and gc.isenabled() and result["meta"]["start_up_heap_frozen"]
    assert "echo stream" in capsys.readouterr().out
