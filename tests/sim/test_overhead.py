"""The serving overhead: its fit on hand-made records, its file, and the simulator applying it."""
import json

import pytest

from splitserve.bench.report import RequestRecord
from splitserve.bench.workload import RequestSpec
from splitserve.cli import main
from splitserve.placement import Role
from splitserve.sim.cluster import simulate
from splitserve.sim.overhead import ServingOverhead, fit_overhead
from splitserve.sim.scenario import PoolSpec, Scenario
from tests.sim.test_sim_cli import write_cpu_profile
from tests.sim.test_sim_worker import LinearPerf


class BatchPerf(LinearPerf):
    """Decode 20 ms alone, 30 ms for two (the fit subtracts the profiled batch's own time)."""

    def decode_time(self, batch, context):
        return 0.01 + 0.01 * batch


def record(prompt, ttft, gap, tokens=5):
    times = tuple(ttft + gap * i for i in range(tokens))
    return RequestRecord(0, prompt, tokens, tokens, 0.0, ttft, times, times[-1], status=200)


def test_fit_on_hand_made_records():
    # alone: gaps 20 + 5 ms = decode(1) + iteration 2 ms + token 3 ms; in pairs: 30 + 2 + 2 x 3 = 38 ms
    perf = BatchPerf()
    # TTFT 100 tokens alone: prefill 0.1 + 5 ms overheads + request 40 ms = 0.145 (the first token
    # leaves from the prompt worker: no KV transfer in it)
    lone = [record(100, 0.145, 0.025), record(100, 0.145, 0.025), record(100, 0.190, 0.040)]
    pairs = [record(100, 0.5, 0.038)] * 3
    fitted = fit_overhead(lone, pairs, perf, perf)
    assert fitted.token_s == pytest.approx(0.003)
    assert fitted.iteration_s == pytest.approx(0.002)
    assert fitted.request_s == pytest.approx(0.040)


def test_fit_finds_a_slower_prefill_across_prompt_sizes():
    # TTFT = 40 ms + 1.5 x prefill (1 ms a token) + 5 ms overheads
    perf = BatchPerf()
    lone = [record(n, 0.040 + 0.0015 * n + 0.005, 0.025) for n in (50, 100, 200, 400)]
    lone.append(record(200, 0.9, 0.025))  # one outlier moves neither the median slope nor the intercept
    fitted = fit_overhead(lone, [record(100, 0.5, 0.038)], perf, perf)
    assert fitted.prefill_scale == pytest.approx(1.5) and fitted.request_s == pytest.approx(0.040)


def test_fit_clips_at_zero():
    perf = BatchPerf()
    # faster than the profile everywhere: nothing to add; pairs no slower than alone: no per-token term
    lone, pairs = [record(100, 0.1, 0.015)], [record(100, 0.1, 0.015)]
    assert fit_overhead(lone, pairs, perf, perf) == ServingOverhead(0.0, 0.0, 0.0)


def test_fit_needs_token_gaps():
    failed = RequestRecord(0, 100, 0, 5, 0.0, None, (), None, error="boom", status=500)
    with pytest.raises(ValueError, match="two or more tokens"):
        fit_overhead([failed, record(100, 0.1, 0.02, tokens=1)], [record(100, 0.1, 0.02)], LinearPerf(), LinearPerf())


def test_file_round_trip_and_bad_files(tmp_path):
    overhead = ServingOverhead(0.03, 0.002, 0.001, host_cores=2, request_cpu_s=0.01, stream_cpu_s=0.0025,
                               prefill_scale=1.2)
    path = overhead.save(tmp_path / "o.json", num_requests=12)
    assert json.loads(path.read_text())["requests"] == 12
    assert ServingOverhead.load(path) == overhead
    (tmp_path / "bad.json").write_text('{"request_ms": 3}')
    with pytest.raises(ValueError, match="request_s, iteration_s, token_s, host_cores, request_cpu_s, stream_cpu_s, "
                                         "prefill_scale"):
        ServingOverhead.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="old.json: a shared host's terms without request_cpu_s"):
        ServingOverhead.from_dict({"request_s": 0.03, "host_cores": 2, "stream_cpu_s": 0.0025}, "old.json")
    with pytest.raises(ValueError, match="host_cores must be a finite number >= 0, got '2'"):
        ServingOverhead.from_dict({"request_s": 0.03, "host_cores": "2"}, "typo.json")
    with pytest.raises(ValueError, match=r"request_cpu_s \(0.04\) must be at most request_s \(0.03\)"):
        ServingOverhead(request_s=0.03, request_cpu_s=0.04)
    with pytest.raises(ValueError, match="saved.json: baseline's overhead: expected an object with"):
        ServingOverhead.from_dict({"peer_slowdown": 0.2}, "saved.json: baseline's overhead")  # a retired term
    with pytest.raises(ValueError, match="token_s"):
        ServingOverhead(token_s=-1.0)
    (tmp_path / "bool.json").write_text('{"request_s": true}')
    with pytest.raises(ValueError, match="request_s must be a finite number of seconds >= 0, got True"):
        ServingOverhead.load(tmp_path / "bool.json")


def test_simulator_applies_every_term():
    overhead = ServingOverhead(request_s=0.05, iteration_s=0.002, token_s=0.003, prefill_scale=1.5)
    scenario = Scenario((PoolSpec(Role.MIXED, 1, "hw"),), {"hw": LinearPerf()}, kv_budget_tokens=4096,
                        max_model_len=2048, placement="jsq", overhead=overhead)
    [r] = simulate(scenario, [RequestSpec(0, 0.0, 100, 3)]).records
    # each iteration: its model time (the prefill's x 1.5) + 2 ms + 3 ms for its one token; the
    # client sees all 50 ms later
    assert r.token_times_s == pytest.approx((0.155 + 0.05, 0.180 + 0.05, 0.205 + 0.05))


def test_sim_cli_takes_the_measured_overhead(tmp_path):
    profile, overhead = tmp_path / "cpu.csv", tmp_path / "overhead.json"
    write_cpu_profile(profile)
    ServingOverhead(request_s=0.5).save(overhead, num_requests=1)
    ttft = {}
    for name, extra in (("plain", []), ("overhead", ["--overhead", str(overhead)])):
        out = tmp_path / name
        assert main(["sim", "--model", "demo", "--profile", str(profile), "--trace", "sharegpt", "--rate", "1",
                     "--length-scale", "0.05", "--num-requests", "20", "--out", str(out), "--no-progress",
                     *extra]) == 0
        ttft[name] = json.loads((out / "summary.json").read_text())["ttft_s"]["p50"]
    assert ttft["overhead"] == pytest.approx(ttft["plain"] + 0.5)


def test_profile_url_needs_the_engine_profile(tmp_path, capsys):
    assert main(["profile", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o.json")]) == 2
    assert "--engine-profile" in capsys.readouterr().err
