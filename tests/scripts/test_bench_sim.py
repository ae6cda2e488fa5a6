"""The simulator's speed benchmark runs end to end on a slice of the trace and reports its rate."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sim.py"


def test_a_slice_of_the_conversation_trace(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sim.json"
    module.main(["--num-requests", "300", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["num_requests"] == report["num_completed"] == 300 and report["wall_time_s"] > 0
    assert "requests/s" in capsys.readouterr().out
