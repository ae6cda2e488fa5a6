"""Checking the simulator against a real cluster: the same trace, replayed against the cluster by the
bench client and through `simulate` on the cluster's own config, its engine profile and the
serving overhead measured just before (`splitserve.sim.overhead`).

Each seed is one round (overhead measurement, two real replays, simulation), so slow drift of the
machine reaches the measurement and the runs it is used for alike. The second replay sends the
same arrivals and lengths with fresh prompt contents (no prefix-cache hits): how far it lands from
the first is the cluster's own reproducibility, the floor under any prediction's error. The
comparison pools every round's requests and reports p50 / p99 of TTFT and TBT with ratios to the
first replay: the simulator with the measured contention for the host's cores ("sim"), without it
("sim_independent", workers on cores of their own, the stack elsewhere) and the second replay ("real_again").
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from splitserve.bench.client import fetch_server_info, fresh_prompt_seed, replay
from splitserve.bench.report import RequestRecord, summarize
from splitserve.bench.runner import fit_to_context
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.config import ClusterConfig
from splitserve.sim.cluster import simulate
from splitserve.sim.from_config import scenario_from_config
from splitserve.sim.overhead import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_SIZES
from splitserve.sim.serving_profile import measure_serving_overhead, profiled_target

METRICS = ("ttft_s", "tbt_s")
RUNS = ("real", "real_again", "sim", "sim_independent")
Log = Callable[[str], None]


def validate(url: str, config: ClusterConfig, engine_profile: Path, workload: WorkloadSpec, seeds: list[int],
             repeats: int = 3, log: Log = print) -> dict:
    """Rounds over `seeds` (each replays `workload` with that seed); the pooled comparison."""
    pooled: dict[str, list[RequestRecord]] = {run: [] for run in RUNS}
    durations = dict.fromkeys(RUNS, 0.0)
    rounds = []
    for seed in seeds:
        overhead, _ = measure_serving_overhead(url, config, engine_profile, DEFAULT_PROMPT_SIZES, DEFAULT_OUTPUT_TOKENS,
                                               repeats, shared_host=True)
        info = asyncio.run(fetch_server_info(url, config.model_name))
        requests = fit_to_context(make_workload(dataclasses.replace(workload, seed=seed)), info.max_model_len)
        runs = {"real": asyncio.run(replay(url, requests, info.model, seed)),
                "real_again": asyncio.run(replay(url, requests, info.model, fresh_prompt_seed(seed, 1)))}
        for run, terms in (("sim", overhead), ("sim_independent", dataclasses.replace(overhead, host_cores=0.0))):
            result = simulate(scenario_from_config(config, profiled_target(config, engine_profile, terms)),
                              requests, seed)
            runs[run] = (list(result.records), result.duration_s)
        round_ = {"seed": seed, "overhead": dataclasses.asdict(overhead)}
        for run, (records, duration) in runs.items():
            round_[run] = _latencies(summarize(records, duration))
            pooled[run] += _reindexed(records, len(pooled[run]))
            durations[run] += duration
        rounds.append(round_)
        log(f"seed {seed}: overhead {_ms(overhead.request_s)} / request, {_ms(overhead.iteration_s)} / iteration, "
            f"{_ms(overhead.token_s)} / token, prefills x {overhead.prefill_scale:.2f}, stack "
            f"{_ms(overhead.stream_cpu_s)} CPU / token on {overhead.host_cores:g} cores; " + ", ".join(
                f"{m} p50 " + " ".join(f"{run} {_ms(round_[run][m]['p50'])}" for run in RUNS) for m in METRICS))
    latencies = {run: _latencies(summarize(pooled[run], durations[run])) for run in RUNS}
    ratios = {f"{run}_over_real": {m: {q: latencies[run][m][q] / latencies["real"][m][q] for q in ("p50", "p99")}
                                   for m in METRICS} for run in RUNS[1:]}
    return {"rounds": rounds, **latencies, **ratios, "num_requests": len(pooled["real"]),
            "num_failed": sum(not r.ok for run in ("real", "real_again") for r in pooled[run])}


def _latencies(summary: dict) -> dict:
    return {m: {q: summary[m][q] for q in ("p50", "p90", "p99")} for m in METRICS}


def _reindexed(records, offset: int) -> list[RequestRecord]:
    return [dataclasses.replace(r, index=offset + i) for i, r in enumerate(records)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
