"""Capacity measured on the test cluster and simulated from its config (splitserve.sim.capacity):
with SLOs nothing misses, both searches end at the top rate after its two probes; with a TBT SLO
no token gap meets, both end at 0 after the first probe. What the two capacities come to on a
quiet machine is scripts/compare_designs.py --capacity's to measure."""
from __future__ import annotations

import pytest

from splitserve.config import ClusterConfig
from splitserve.sim.capacity import CapacitySpec, capacity_overhead, measured_capacity, probe_rows, simulated_capacity
from splitserve.sim.host_cpu import host_cores
from splitserve.sim.profile import ProfileSpec, run_profile, write_csv
from tests.ray_cluster import MAIN

SHORT = dict(length_scale=0.05, rate_low=1.0, rate_high=2.0, iterations=0, duration_s=4.0, min_requests=4)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    config = ClusterConfig.model_validate(MAIN)
    spec = ProfileSpec(config.model, "cpu", repeats=1, prompt_sizes=(32, 128, 512), batch_sizes=(1, 2, 4))
    return config, write_csv(run_profile(spec).rows, tmp_path_factory.mktemp("capacity") / "engine.csv")


@pytest.fixture(scope="module")
def overhead(server, profiled):
    """Measured once, on one run of each prompt size and concurrency (about 40 s here): both searches
    run on the same cluster, and neither's capacity depends on how precise the overhead is."""
    overhead = capacity_overhead(server, *profiled, repeats=1)
    # the stack adds to every TTFT: as a cost per request, as a slower prefill, or both (a one-repeat
    # fit may put all of it in the slope, clamping the intercept at 0)
    assert overhead.request_s > 0 or overhead.prefill_scale > 1
    # the cluster runs on this machine: its cores, and the proxy, ingress and client spend CPU on every token
    assert overhead.host_cores == host_cores() and overhead.stream_cpu_s > 0
    return overhead


@pytest.mark.parametrize("tbt_slo_s, capacity, probes", [(60.0, 2.0, [1.0, 2.0]), (1e-9, 0.0, [1.0])],
                         ids=["all-pass", "none-pass"])
def test_measured_and_simulated_searches_agree_at_the_extremes(server, profiled, overhead, tbt_slo_s, capacity,
                                                               probes):
    config, profile = profiled
    spec = CapacitySpec(**SHORT, tbt_slo_s=tbt_slo_s, ttft_slo_s=60.0)
    measured = measured_capacity("main", server, config, profile, spec, overhead=overhead)
    assert measured.capacity_rps == capacity and [rate for rate, _ in measured.probes] == probes
    assert measured.overhead is overhead and measured.max_model_len == MAIN["engine"]["max_model_len"]
    assert (measured.records_at_capacity is not None) == (capacity > 0)
    simulated, simulated_probes = simulated_capacity(measured, config, profile, spec)
    assert simulated == capacity and [rate for rate, _ in simulated_probes] == probes
    rows = probe_rows("main", measured.probes)
    assert [r["num_requests"] for r in rows] == [4, 8][:len(probes)] and all(r["num_failed"] == 0 for r in rows)
