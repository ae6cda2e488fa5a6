"""`splitserve sim`: a deployment's config file simulated on a trace, with the bench's report."""
from __future__ import annotations

import csv
import json

from splitserve.cli import main
from splitserve.sim.perf_model import CSV_COLUMNS


def write_cpu_profile(path) -> None:
    """A hand-made `splitserve profile`-style CSV for hardware class cpu: prefill 0.1 ms a token,
    decode 4 ms an iteration growing with the batch."""
    rows = [dict(prompt_size=p, batch_size=1, prompt_time=0.1 * p, token_time=4.0) for p in (32, 128, 512)]
    rows += [dict(prompt_size=128, batch_size=b, prompt_time=0.1 * 128 * b, token_time=4.0 + b) for b in (2, 8, 32)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            e2e = row["prompt_time"] + 15 * row["token_time"]
            writer.writerow({"model": "demo", "hardware": "cpu", "token_size": 16, "peak_power": 0,
                             "average_power": 0, "e2e_time": e2e, "tensor_parallel": 1, **row})


def test_a_deploy_file_simulates_into_the_bench_report(tmp_path, capsys):
    out = tmp_path / "ha"
    assert main(["sim", "--config", "deploy/splitwise-ha.yaml", "--trace", "conv", "--rate", "5",
                 "--num-requests", "200", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 200 and summary["num_failed"] == 0
    assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"] and summary["wall_s"] > 0
    workers = json.loads((out / "workers.json").read_text())
    assert sorted(w["hardware"] for w in workers) == ["a100", "a100", "h100", "h100"]
    assert {p.name for p in out.iterdir()} >= {"requests.jsonl", "report.md", "latency_cdf.png"}
    assert "simulated in" in capsys.readouterr().out


def test_the_local_cpu_default_with_a_measured_profile(tmp_path):
    profile = tmp_path / "cpu.csv"
    write_cpu_profile(profile)
    out = tmp_path / "cpu"
    assert main(["sim", "--model", "demo", "--tensor-parallel", "1", "--profile", str(profile), "--trace",
                 "sharegpt", "--rate", "2", "--length-scale", "0.05", "--num-requests", "50", "--out", str(out),
                 "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 50 and all(r["output_tokens"] == r["requested_output_tokens"] for r in records)


def test_a_class_without_a_profile_is_a_clear_error(tmp_path, capsys):
    assert main(["sim", "--trace", "conv", "--rate", "1", "--num-requests", "5", "--out", str(tmp_path)]) == 2
    assert "splitserve profile --hardware cpu" in capsys.readouterr().err
