"""The Splitwise reproduction runs end to end at a tiny scale, prints our numbers beside the paper's and
draws Fig. 16 and Fig. 18."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reproduce_splitwise.py"


def test_tiny_reproduction_writes_every_design(tmp_path):
    out = tmp_path / "repro.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--traces", "conv", "--scale", "0.1", "--duration-s", "3",
                           "--iterations", "1", "--serial", "--json", str(out), "--out", str(tmp_path / "figs")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    designs = {row["design"] for row in rows}
    assert {"baseline-a100", "baseline-h100", "splitwise-aa", "splitwise-hh", "splitwise-ha",
            "splitwise-hhcap"} <= designs
    assert "REDUCED" in done.stdout and "paper" in done.stdout
    # Fig. 16 per trace, Fig. 18 for all: real PNG files
    assert {row["decode_rule"] for row in rows} == {"splitwise-sim", "context"}
    for name in ("latency_vs_load_conv_context.png", "summary_bars_context.png",
                 "latency_vs_load_conv_splitwise-sim.png", "summary_bars_splitwise-sim.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
