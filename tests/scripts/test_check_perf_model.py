"""The iteration check runs end to end: every phase's measured / modelled ratios, from a real engine."""
import subprocess
import sys
from pathlib import Path

from splitserve.sim.profile import ProfileSpec, run_profile, write_csv

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_perf_model.py"


def test_a_short_run_prints_ratios_per_phase(tmp_path):
    spec = ProfileSpec(prompt_sizes=(16, 256), batch_sizes=(1, 4), repeats=1, token_size=4, chunk_size=64,
                       chunk_contexts=(256,))
    profile = write_csv(run_profile(spec).rows, tmp_path / "cpu.csv")
    out = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile), "--num-requests", "6"],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("prefill", "decode", "mixed"):
            rows[cells[0]] = (int(cells[1]), *map(float, cells[2:]))
    assert {"decode", "mixed"} <= set(rows)  # chunks of 256 beside decodes, and decodes alone
    for count, p10, median, p90 in rows.values():
        assert count > 0 and 0 < p10 <= median <= p90
