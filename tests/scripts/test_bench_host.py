"""The host-time benchmark: its model clock takes exactly the model's time out of a step, its idle
clock the gap from sampled ids read to the next forward, and a tiny run end to end reports both
output positions of every batch in both modes, both ways of scheduling."""
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


def test_the_idle_clock_times_from_the_ids_read_to_the_next_forward():
    model = _SlowModel()
    clock = bench_host.IdleClock(model)
    try:
        drawn = bench_host.Drawn(torch.tensor([5, 7]), None, [None, None])
        model(1)  # no ids read before it: no gap
        assert drawn.read()[1].token_id == 7
        time.sleep(0.03)
        model(1)
        model(1)  # nothing read since the last forward: no gap
        gaps = clock.take()
        assert len(gaps) == 1 and 0.03 <= gaps[0] < 0.2 and clock.take() == []
    finally:
        clock.restore()
    assert bench_host.Drawn.read is not None and "read_ended" not in bench_host.Drawn.read.__qualname__


def test_tiny_run_reports_both_output_positions_of_every_batch(tmp_path):
    out = tmp_path / "host.json"
    done = run_script("bench_host", "--modes", "ids,text", "--batches", "1,3", "--context", "40", "--output-len", "12",
                      "--steps", "4", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"], r["scheduling"], r["output_position"]) for r in rows] == \
        [(m, b, s, p) for m in ("ids", "text") for b in (1, 3) for s in ("sync", "async") for p in (4, 12)]
    for r in rows:
        assert r["context"] == 40 and 0 < r["host_ms"] <= r["host_ms_p90"] and r["model_ms"] > 0
        assert 0 < r["device_idle_ms"] < r["host_ms"]
        assert r["host_us_per_seq"] * r["batch"] == pytest.approx(r["host_ms"] * 1e3)
    assert run_script("bench_host", "--output-len", "5", "--steps", "4").returncode == 2
    assert run_script("bench_host", "--modes", "bytes").returncode == 2
    assert run_script("bench_host", "--scheduling", "overlap").returncode == 2
