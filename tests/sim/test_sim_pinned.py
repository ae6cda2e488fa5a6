"""Pins the simulated latencies of a slice of the speed benchmark's two runs (issue 20): Splitwise-HH on
the code trace (35 prompt / 5 token machines) and the conversation trace (25 / 15), Llama2-70B,
Poisson arrivals at 70 req/s, splitwise-sim's decode rule, 3,000 requests each.

The numbers were recorded from the simulator before its speed work (commit 5827635), and TTFT and TBT
again once a split request's first token came from its prompt worker (as the real cluster streams it)
rather than at its KV's landing (end to end unchanged); a change to the simulation's semantics moves
them, a change to its speed must not (2% tolerance)."""
from __future__ import annotations

import json

import pytest

from splitserve.cli import main

PINNED = {  # trace: (prompt machines, token machines, completed, {metric: (p50, p99)})
    "code": (35, 5, 3000, {"ttft_s": (0.10148225205360006, 0.7474562586637887),
                           "tbt_s": (0.03134074210669624, 0.06342740186519047),
                           "e2e_s": (0.5975576569919809, 7.109119507580185)}),
    "conv": (25, 15, 3000, {"ttft_s": (0.07731158990236509, 0.383106934396622),
                            "tbt_s": (0.031114883332108434, 0.031441123784290426),
                            "e2e_s": (4.104117115472009, 18.024774689895334)}),
}


@pytest.mark.parametrize("trace", PINNED)
def test_latencies_stay_as_recorded(trace, tmp_path):
    prompt_machines, token_machines, completed, latencies = PINNED[trace]
    out = tmp_path / "summary.json"
    assert main(["sim", "--design", "splitwise-hh", "--prompt-machines", str(prompt_machines),
                 "--token-machines", str(token_machines), "--trace", trace, "--rate", "70", "--num-requests", "3000",
                 "--decode-rule", "splitwise-sim", "--json", str(out), "--no-progress"]) == 0
    summary = json.loads(out.read_text())
    assert summary["num_completed"] == completed
    for metric, (p50, p99) in latencies.items():
        assert summary[metric]["p50"] == pytest.approx(p50, rel=0.02), metric
        assert summary[metric]["p99"] == pytest.approx(p99, rel=0.02), metric
