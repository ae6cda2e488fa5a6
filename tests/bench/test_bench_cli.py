"""The benchmark end to end against the test run's local cluster: in-process, and as a Ray job
submitted to the head node (`ray job submit -- python -m splitserve.bench ...`), as users run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from splitserve.bench.cli import main

SUMMARY_KEYS = {"num_requests", "num_failed", "throughput_rps", "ttft_s", "tbt_s", "e2e_s"}


def check_summary(summary: dict, num_requests: int) -> None:
    assert SUMMARY_KEYS <= set(summary) and summary["num_requests"] == num_requests
    assert summary["num_failed"] == 0 and summary["throughput_rps"] > 0
    for metric in ("ttft_s", "tbt_s", "e2e_s"):
        assert 0 < summary[metric]["p50"] <= summary[metric]["p90"] <= summary[metric]["p99"]


def test_short_bench_writes_every_output(server, tmp_path):
    out = tmp_path / "run"
    code = main(["--url", server, "--trace", "conv", "--num-requests", "12", "--rate", "6", "--length-scale", "0.1",
                 "--out", str(out), "--no-progress", "--tbt-slo", "1.0"])
    assert code == 0
    assert {p.name for p in out.iterdir()} >= {"summary.json", "requests.jsonl", "report.md", "latency_cdf.png"}
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 12)
    assert set(summary["slo"]) >= {"slowdown", "absolute", "all_met"}  # Table VI from the calibration pass
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 12
    assert all(r["output_tokens"] == r["requested_output_tokens"] == len(r["token_times_s"]) for r in records)


def test_bench_replays_the_mooncake_trace_with_its_shared_prefixes(server, tmp_path):
    out = tmp_path / "mooncake"
    # its first 8 rows arrive at once and all start with block 0 (a system prompt of 10 tokens here)
    assert main(["--url", server, "--trace", "mooncake", "--num-requests", "8", "--length-scale", "0.02",
                 "--no-calibrate", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 8)
    # the server's usage says how many prompt tokens its prefix cache held (whole blocks of 16)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    cached = [r["cached_tokens"] for r in records]
    assert all(isinstance(c, int) and c % 16 == 0 for c in cached)
    assert summary["prompt_cached_share"] == sum(cached) / sum(r["prompt_tokens"] for r in records)


def test_the_splitserve_command_runs_the_bench_as_python_m_does(server, tmp_path):
    """`splitserve bench` (the README's command) writes the same outputs as `python -m splitserve.bench`."""
    from splitserve.cli import main as splitserve

    out = tmp_path / "command"
    assert splitserve(["bench", "--url", server, "--trace", "fixed", "--prompt-tokens", "32", "--output-tokens", "4",
                       "--num-requests", "3", "--rate", "6", "--no-calibrate", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 3)
    assert summary["workload"]["trace"] == "fixed" and "api_key" not in summary["workload"]


def test_capacity_search_probes_rates(server, tmp_path):
    out = tmp_path / "capacity"
    code = main(["--url", server, "--trace", "fixed", "--prompt-tokens", "32", "--output-tokens", "8",
                 "--num-requests", "8", "--out", str(out), "--no-progress", "--no-calibrate", "--capacity",
                 "--tbt-slo", "5.0", "--rate-low", "2", "--rate-high", "8", "--iterations", "1"])
    assert code == 0
    result = json.loads((out / "capacity.json").read_text())
    assert result["capacity_rps"] == 8 and [p["rate"] for p in result["probes"]] == [2, 8]
    assert (out / "latency_vs_load.png").stat().st_size > 1000


def test_bad_arguments_are_reported(server, tmp_path, capsys):
    assert main(["--url", server, "--trace", "nope", "--out", str(tmp_path)]) == 2
    assert "trace" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--trace", "conv", "--out", str(tmp_path)]) == 2
    assert "cannot talk to http://127.0.0.1:9" in capsys.readouterr().err


def test_a_bad_url_or_results_folder_is_reported_before_any_request(tmp_path, capsys):
    """No server needed: each is refused up front (exit 2), where the folder used to fail only after
    the whole run and an uncalibrated run against a dead server raised httpx's traceback."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    quick = ["--trace", "fixed", "--num-requests", "2", "--rate", "50", "--no-progress"]
    for url, out, message in (("127.0.0.1:8000", tmp_path / "o", "--url must be an http:// or https:// URL"),
                              ("http://[::1", tmp_path / "o", "is not a URL"),
                              ("http://127.0.0.1:9", taken, "File exists"),
                              ("http://127.0.0.1:9", tmp_path / "o", "cannot talk to http://127.0.0.1:9")):
        assert main(["--url", url, *quick, "--no-calibrate", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", *quick, "--capacity", "--out", str(tmp_path / "o")]) == 2
    assert "--capacity needs --tbt-slo" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", *quick, "--priority-mix", "0:x", "--out", str(tmp_path / "o")]) == 2
    assert "--priority-mix: '0:x' is not PRIORITY:SHARE" in capsys.readouterr().err


def test_a_run_longer_than_a_day_or_past_a_million_requests_is_refused(tmp_path, capsys):
    """--rate 1e-9 slept for decades between arrivals, and --num-requests 100000000 built a list of
    100M requests: both are refused up front (exit 2), naming the flag."""
    base = ["--url", "http://127.0.0.1:9", "--trace", "fixed", "--no-calibrate", "--no-progress"]
    for flags, message in ((["--num-requests", "3", "--rate", "1e-9"], "--rate 1e-09: the last of 3 requests"),
                           (["--num-requests", "86402", "--rate", "1"], "--rate 1: the last of 86,402 requests"),
                           (["--num-requests", "10", "--capacity", "--tbt-slo", "1", "--rate-low", "1e-6"],
                            "--rate-low 1e-06: the last of 10 requests"),
                           (["--num-requests", "100000000", "--rate", "1e6"], "--num-requests must be at most "
                                                                               "1,000,000, got 100,000,000")):
        assert main([*base, *flags, "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything else
    assert main([*base, "--num-requests", "1", "--rate", "1e-9", "--out", str(tmp_path / "o")]) == 2
    assert "cannot talk to http://127.0.0.1:9" in capsys.readouterr().err  # past the check: one request, no gap


def test_a_zero_slo_bound_is_refused_not_dropped():
    from splitserve.bench.cli import slo_of

    args = type("Args", (), {"ttft_slo": 0.0, "tbt_slo": None, "no_calibrate": True})()
    with pytest.raises(ValueError, match="the ttft p99 bound must be positive, got 0.0"):
        slo_of(args)


def test_ray_job_submit_runs_the_bench_on_the_head_node(head_node, server, tmp_path):
    _, dashboard = head_node
    out = tmp_path / "job"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # Ray >= 2.59: the job CLI must send the head's token
    command = ["ray", "job", "submit", "--address", dashboard, "--", sys.executable, "-m", "splitserve.bench",
               "--url", server, "--trace", "sharegpt", "--num-requests", "6", "--rate", "4", "--length-scale", "0.02",
               "--no-calibrate", "--no-progress", "--out", str(out)]
    for _ in range(10):  # a fresh head's job agent takes a few seconds to come up
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if "No available agent" not in done.stdout + done.stderr:
            break
        time.sleep(2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "succeeded" in done.stdout + done.stderr
    check_summary(json.loads((out / "summary.json").read_text()), 6)
