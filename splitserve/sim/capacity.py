"""Capacity of a cluster, measured and simulated: Sarathi-Serve's metric, the highest Poisson rate
whose P99 TBT and P99 TTFT meet their SLOs with no request failed or refused, found by geometric
bisection (`splitserve.bench.slo.capacity_search`).

The real search replays the workload against a running cluster; the simulated one runs the same
probes through `simulate` on the cluster's config, its engine profile and the serving overhead
measured on it just before (as `splitserve.sim.validate` does). Every probe at rate r replays
max(min_requests, r x duration_s) requests of the same trace and seed, real or simulated; each real
probe sends prompts of its own (`Target`: the workers' prefix caches keep the earlier probes'
prompts, and the simulator, like a cluster serving new prompts, has none of them).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench.client import fetch_server_info
from splitserve.bench.report import RequestRecord
from splitserve.bench.runner import Target, fit_to_context, run_once
from splitserve.bench.slo import capacity_search, p99s_within
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.config import ClusterConfig
from splitserve.sim.cluster import simulate
from splitserve.sim.from_config import scenario_from_config
from splitserve.sim.overhead import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_SIZES, ServingOverhead
from splitserve.sim.serving_profile import measure_serving_overhead, profiled_target

OVERHEAD_REPEATS = 3
PROBE_KEYS = ("num_requests", "num_failed", "num_rejected", "throughput_rps", "ttft_s", "tbt_s", "e2e_s")


@dataclass(frozen=True)
class CapacitySpec:
    """What a capacity search sends and what it must meet."""

    trace: str = "conv"
    length_scale: float = 0.25
    max_prompt_tokens: int | None = 1536
    seed: int = 0
    tbt_slo_s: float = 0.05
    ttft_slo_s: float = 1.0
    rate_low: float = 1.0
    rate_high: float = 16.0
    iterations: int = 4
    duration_s: float = 30.0
    min_requests: int = 40

    def workload(self, rate: float) -> WorkloadSpec:
        return WorkloadSpec(trace=self.trace, num_requests=max(self.min_requests, round(rate * self.duration_s)),
                            rate=rate, arrivals="poisson", length_scale=self.length_scale,
                            max_prompt_tokens=self.max_prompt_tokens, seed=self.seed)

    def search(self, run_at_rate) -> tuple[float, list[tuple[float, dict]]]:
        return capacity_search(run_at_rate, p99s_within(self.tbt_slo_s, self.ttft_slo_s), self.rate_low,
                               self.rate_high, self.iterations, geometric=True)


@dataclass
class Capacity:
    """One cluster's search: the capacity, every probe's summary (rate order of probing), what the
    simulated search needs (the overhead and context measured on the cluster) and the requests at
    capacity (for a CDF)."""

    name: str
    capacity_rps: float
    probes: list[tuple[float, dict]]
    overhead: ServingOverhead
    max_model_len: int | None
    records_at_capacity: list[RequestRecord] | None


def capacity_overhead(url: str, config: ClusterConfig, engine_profile: Path,
                      repeats: int = OVERHEAD_REPEATS) -> ServingOverhead:
    """The serving overhead of the cluster at `url` (deployed with `config`, on this host), which
    the simulated search adds to `engine_profile`'s times; fitted on `repeats` groups of each
    prompt size at each concurrency (fewer: sooner measured, noisier)."""
    return measure_serving_overhead(url, config, engine_profile, DEFAULT_PROMPT_SIZES, DEFAULT_OUTPUT_TOKENS,
                                    repeats, shared_host=True)[0]


def measured_capacity(name: str, url: str, config: ClusterConfig, engine_profile: Path, spec: CapacitySpec,
                      log=print, progress: bool = False, overhead: ServingOverhead | None = None,
                      overhead_repeats: int = OVERHEAD_REPEATS) -> Capacity:
    """The cluster at `url` (deployed with `config`): its serving overhead (`capacity_overhead` of
    `overhead_repeats`, measured now unless given: it does not depend on the SLOs), then the real search."""
    info = asyncio.run(fetch_server_info(url, None))
    if overhead is None:
        overhead = capacity_overhead(url, config, engine_profile, overhead_repeats)
    target, records = Target(url), {}

    def measured(rate: float) -> dict:
        records[rate], summary = asyncio.run(run_once(target, spec.workload(rate), None, None, progress,
                                                      f"{name} @ {rate:.2f} req/s"))
        log(f"  {name} @ {rate:.2f} req/s: {brief(summary, spec)}")
        return summary

    capacity, probes = spec.search(measured)
    return Capacity(name, capacity, probes, overhead, info.max_model_len, records.get(capacity))


def simulated_capacity(measured: Capacity, config: ClusterConfig, engine_profile: Path, spec: CapacitySpec,
                       log=print) -> tuple[float, list[tuple[float, dict]]]:
    """The same search in the simulator: `config`, `engine_profile` and the overhead measured with it."""
    scenario = scenario_from_config(config, profiled_target(config, engine_profile, measured.overhead))

    def simulated(rate: float) -> dict:
        workload = spec.workload(rate)
        summary = simulate(scenario, fit_to_context(make_workload(workload), measured.max_model_len),
                           workload.seed).summary()
        log(f"  {measured.name} @ {rate:.2f} req/s, simulated: {brief(summary, spec)}")
        return summary

    return spec.search(simulated)


def probe_rows(name: str, probes: list[tuple[float, dict]]) -> list[dict]:
    """Rows for `bench.plots.latency_vs_load`."""
    return [{"design": name, "rate": rate, **{k: summary[k] for k in PROBE_KEYS}} for rate, summary in probes]


def brief(summary: dict, spec: CapacitySpec) -> str:
    ttft, tbt = summary["ttft_s"]["p99"], summary["tbt_s"]["p99"]
    met = p99s_within(spec.tbt_slo_s, spec.ttft_slo_s)(summary)
    return (f"P99 TTFT {'-' if ttft is None else f'{ttft:.3f}'} s, P99 TBT {'-' if tbt is None else f'{tbt:.4f}'} s, "
            f"{summary['num_failed']} failed, {summary['num_rejected']} refused: {'meets' if met else 'misses'}")
