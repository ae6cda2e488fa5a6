"""bench_priority.py: a small workload runs end to end on the CPU under both schedulings, every
request with the same output under both; by priority an interactive request is admitted at its
arrival, first come, first served it waits for the backlog."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_priority.py"


def test_interactive_requests_overtake_the_backlog_by_priority_alone(tmp_path):
    out = tmp_path / "priority.json"
    subprocess.run([sys.executable, str(SCRIPT), "--backlog", "8", "--chats", "3", "--backlog-tokens", "16",
                    "--max-num-seqs", "4", "--json", str(out)], check=True, capture_output=True, timeout=300)
    fcfs, priority = json.loads(out.read_text())["rows"]
    assert (fcfs["policy"], priority["policy"]) == ("fcfs", "priority") and priority["same_outputs"]
    assert priority["chat_ttft_max_steps"]["max"] == 1 < fcfs["chat_ttft_max_steps"]["min"]
    assert priority["preemptions"]["min"] >= 1 and fcfs["preemptions"]["max"] == 0


def test_a_count_under_one_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--every", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--every must be at least 1" in done.stderr
