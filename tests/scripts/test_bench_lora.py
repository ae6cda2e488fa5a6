"""bench_lora.py: a small run on the CPU steps each batch on the base model and under one and
several adapters, which the engine's running sequences were bound to; a device it cannot use is refused."""
import json

import pytest

from tests.scripts.script_runner import run_script


def test_each_batch_runs_on_the_base_model_and_under_its_adapters(tmp_path):
    out = tmp_path / "lora.json"
    done = run_script("bench_lora", "--batches", "1,6", "--spreads", "0,1,3", "--context", "20", "--steps", "2",
                      "--warm-up", "1", "--rank", "4", "--repeats", "2", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["spread"], r["adapters_in_step"]) for r in rows] == \
        [(1, 0, 0), (1, 1, 1), (1, 3, 1), (6, 0, 0), (6, 1, 1), (6, 3, 3)]
    for base, row in ((rows[0], rows[2]), (rows[3], rows[5])):
        assert row["vs_base"] == pytest.approx(row["step_ms"] / base["step_ms"])
    assert all(r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] for r in rows)


def test_a_device_it_cannot_use_is_refused():
    done = run_script("bench_lora", "--device", "tpu", timeout=120)
    assert done.returncode == 2 and "--device takes cpu" in done.stderr
