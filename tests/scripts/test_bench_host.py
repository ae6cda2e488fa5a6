"""The host-time benchmark: its model clock takes exactly the model's time out of a step, and a
tiny run end to end reports both output positions of every batch in both modes."""
import json
import time

import pytest
import torch

from tests.scripts.script_runner import load_script, run_script

bench_host = load_script("bench_host")


class _SlowModel(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x

    def compute_logits(self, x):
        time.sleep(0.01)
        return x


def test_the_model_clock_counts_forward_and_logits_and_resets():
    model = _SlowModel()
    clock = bench_host.ModelClock(model)
    model(1)
    model.compute_logits(2)
    assert 0.03 <= clock.take() < 0.2
    assert clock.take() == 0.0


def test_tiny_run_reports_both_output_positions_of_every_batch(tmp_path):
    out = tmp_path / "host.json"
    done = run_script("bench_host", "--modes", "ids,text", "--batches", "1,3", "--context", "40", "--output-len", "12", "--steps", "4",
                      "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"], r["output_position"]) for r in rows] == \
        [(m, b, p) for m in ("ids", "text") for b in (1, 3) for p in (4, 12)]
    for r in rows:
        assert r["context"] == 40 and 0 < r["host_ms"] <= r["host_ms_p90"] and r["model_ms"] > 0
        assert r["host_us_per_seq"] * r["batch"] == pytest.approx(r["host_ms"] * 1e3)
    assert run_script("bench_host", "--output-len", "5", "--steps", "4").returncode == 2
    assert run_script("bench_host", "--modes", "bytes").returncode == 2
