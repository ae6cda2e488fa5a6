"""Checking the simulator against a real cluster: the same trace, replayed against the cluster by the
bench client and through `simulate` on the cluster's own config, its engine profile and the
serving overhead measured just before (`splitserve.sim.overhead`).

Each seed is one round (overhead measurement, real replay, simulation), so slow drift of the
machine reaches the measurement and the run it is used for alike. The comparison pools every
round's requests, real and simulated, and reports p50 / p99 of TTFT and TBT with sim / real ratios.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from splitserve.bench.report import RequestRecord, summarize
from splitserve.bench.runner import Target, fit_to_context, run_once
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.cluster.config import ClusterConfig
from splitserve.sim.cluster import simulate
from splitserve.sim.from_config import scenario_from_config
from splitserve.sim.overhead import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_SIZES
from splitserve.sim.serving_profile import measure_serving_overhead, profiled_target

METRICS = ("ttft_s", "tbt_s")
Log = Callable[[str], None]


def validate(url: str, config: ClusterConfig, engine_profile: Path, workload: WorkloadSpec, seeds: list[int],
             repeats: int = 3, log: Log = print) -> dict:
    """Rounds over `seeds` (each replays `workload` with that seed); the pooled comparison."""
    real: list[RequestRecord] = []
    simulated: list[RequestRecord] = []
    rounds, real_s, sim_s = [], 0.0, 0.0
    for seed in seeds:
        overhead, _ = measure_serving_overhead(url, config, engine_profile, DEFAULT_PROMPT_SIZES, DEFAULT_OUTPUT_TOKENS,
                                               repeats)
        spec = dataclasses.replace(workload, seed=seed)
        records, summary = asyncio.run(run_once(Target(url), spec, None, None, progress=False))
        requests = fit_to_context(make_workload(spec), config.engine.max_model_len)  # as the bench client sends them
        scenario = scenario_from_config(config, profiled_target(config, engine_profile, overhead))
        result = simulate(scenario, requests, seed)
        round_ = {"seed": seed, "overhead": dataclasses.asdict(overhead), "real": _latencies(summary),
                  "sim": _latencies(result.summary())}
        rounds.append(round_)
        log(f"seed {seed}: overhead {_ms(overhead.request_s)} / request, {_ms(overhead.iteration_s)} / iteration, "
            f"{_ms(overhead.token_s)} / token; " + ", ".join(
                f"{m} p50 real {_ms(round_['real'][m]['p50'])} sim {_ms(round_['sim'][m]['p50'])}" for m in METRICS))
        real += _reindexed(records, len(real))
        simulated += _reindexed(result.records, len(simulated))
        real_s += summary["duration_s"]
        sim_s += result.duration_s
    pooled_real, pooled_sim = _latencies(summarize(real, real_s)), _latencies(summarize(simulated, sim_s))
    ratios = {m: {q: pooled_sim[m][q] / pooled_real[m][q] for q in ("p50", "p99")} for m in METRICS}
    return {"rounds": rounds, "real": pooled_real, "sim": pooled_sim, "sim_over_real": ratios,
            "num_requests": len(real), "num_failed": sum(not r.ok for r in real)}


def _latencies(summary: dict) -> dict:
    return {m: {q: summary[m][q] for q in ("p50", "p90", "p99")} for m in METRICS}


def _reindexed(records, offset: int) -> list[RequestRecord]:
    return [dataclasses.replace(r, index=offset + i) for i, r in enumerate(records)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
