"""The simulator against the real test cluster (splitserve.sim.validate): the engine profiled in
this process, the serving overhead measured on the cluster, one short conversation trace replayed
for real and simulated from the cluster's own config. scripts/validate_sim.py runs more rounds;
the README reports its pooled numbers. On 2 shared cores one round's p50s vary by tens of
percent from run to run, so this bounds the prediction loosely: a simulator that lost the
overhead, the transfer or the batching would be off by far more. It runs first (`quiet`): later,
other tests' apps and workers share the two cores (in one full run, the real TTFT came out 1.8x
what it is alone, past the bound). Even first, one replay can land far from the other (CI on a
fresh machine: TTFT p50 165 ms, then 111 ms, simulated 79 ms), so the prediction is bounded
against the nearer of the two replays, the cluster's own spread being the floor under its error."""
from __future__ import annotations

import pytest

from splitserve.bench.workload import WorkloadSpec
from splitserve.config import ClusterConfig
from splitserve.sim.profile import ProfileSpec, run_profile, write_csv
from splitserve.sim.validate import validate
from tests.ray_cluster import MAIN


@pytest.mark.quiet
def test_the_simulator_predicts_the_cluster(server, tmp_path):
    config = ClusterConfig.model_validate(MAIN)
    spec = ProfileSpec(config.model, "cpu", repeats=1, prompt_sizes=(32, 128, 512, 1024), batch_sizes=(1, 2, 4))
    profile = write_csv(run_profile(spec).rows, tmp_path / "engine.csv")
    workload = WorkloadSpec("conv", 30, rate=1.0, arrivals="poisson", length_scale=0.25)
    lines = []
    result = validate(server, config, profile, workload, seeds=[7], repeats=2, log=lines.append, alone=4)
    print("\n".join(lines), result["sim_over_real"], result["sim_independent_over_real"])
    assert result["num_requests"] == 30 and result["num_failed"] == 0
    overhead = result["rounds"][0]["overhead"]
    assert overhead["request_s"] > 0  # HTTP, Serve and the CLS cost something
    assert 0 < overhead["request_cpu_s"] <= overhead["request_s"]  # part of it the stack's CPU on the shared cores
    for metric in ("ttft_s", "tbt_s"):
        sim = result["sim"][metric]["p50"]
        assert any(0.5 <= sim / result[run][metric]["p50"] <= 2.0 for run in ("real", "real_again")), (metric, result)
    assert 0.5 <= result["alone"]["sim_over_real"] <= 2.0, result["alone"]  # sent one at a time, and simulated
    gaps = result["tbt_by_class"]  # each request's hand-off gap, real and simulated, classed apart from the rest
    assert gaps["real"]["handoff"]["n"] == gaps["sim"]["handoff"]["n"] == 30, gaps
