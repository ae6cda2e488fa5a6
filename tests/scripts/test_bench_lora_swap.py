"""bench_lora_swap.py: a small workload runs end to end on the CPU with a slot per adapter and with
fewer slots, every request with the same output; only the engine with fewer slots swaps."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_lora_swap.py"


def test_fewer_slots_than_adapters_swap_and_give_the_same_outputs(tmp_path):
    out = tmp_path / "swap.json"
    subprocess.run([sys.executable, str(SCRIPT), "--adapters", "4", "--slots", "1", "--requests", "6", "--prompt", "16",
                    "--tokens", "3", "--rank", "4", "--json", str(out)], check=True, capture_output=True, timeout=300)
    resident, one_slot = json.loads(out.read_text())["rows"]
    assert (resident["slots"], one_slot["slots"]) == (4, 1) and one_slot["same_outputs"]
    assert resident["swaps"]["max"] == 0 < one_slot["swaps"]["min"]


def test_more_slots_than_adapters_are_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--adapters", "2", "--slots", "3"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--slots must be from 1 to --adapters" in done.stderr
