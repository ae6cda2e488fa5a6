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
With `alone` > 0 each round also sends the trace's first `alone` requests one at a time (each after
the previous ended and a pause, as the overhead's calibration sends them) and simulates them at
the times they were sent: with no load to model, their error is the calibration's alone.
`tbt_by_class` pools each run's token gaps by what else ran during them (`splitserve.sim.token_gaps`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from splitserve.bench.client import fetch_server_info, fresh_prompt_seed, replay
from splitserve.bench.report import RequestRecord, summarize
from splitserve.bench.runner import fit_to_context
from splitserve.bench.workload import RequestSpec, WorkloadSpec, make_workload
from splitserve.config import ClusterConfig
from splitserve.sim.cluster import simulate
from splitserve.sim.from_config import scenario_from_config
from splitserve.sim.overhead import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_SIZES, send_group
from splitserve.sim.serving_profile import measure_serving_overhead, profiled_target
from splitserve.sim.token_gaps import GAP_CLASSES, classify_gaps, gap_summary, merge_gaps

METRICS = ("ttft_s", "tbt_s")
RUNS = ("real", "real_again", "sim", "sim_independent")
Log = Callable[[str], None]


def validate(url: str, config: ClusterConfig, engine_profile: Path, workload: WorkloadSpec, seeds: list[int],
             repeats: int = 3, log: Log = print, alone: int = 0) -> dict:
    """Rounds over `seeds` (each replays `workload` with that seed); the pooled comparison."""
    pooled: dict[str, list[RequestRecord]] = {run: [] for run in RUNS}
    gaps = {run: {name: [] for name in GAP_CLASSES} for run in RUNS}  # classed within each round's run
    lone: dict[str, list[RequestRecord]] = {"real": [], "sim": []}
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
            merge_gaps(gaps[run], classify_gaps(records))
            durations[run] += duration
        if alone:
            real, simulated = _one_at_a_time(url, config, engine_profile, overhead, requests[:alone], info.model,
                                             fresh_prompt_seed(seed, 2))
            round_["alone"] = {"real": _ttft(real), "sim": _ttft(simulated)}
            lone["real"] += _reindexed(real, len(lone["real"]))
            lone["sim"] += _reindexed(simulated, len(lone["sim"]))
            log(f"seed {seed}, {len(real)} requests one at a time: ttft_s p50 real {_ms(round_['alone']['real'])} "
                f"sim {_ms(round_['alone']['sim'])}")
        rounds.append(round_)
        log(f"seed {seed}: overhead {_ms(overhead.request_s)} / request, {_ms(overhead.iteration_s)} / iteration, "
            f"{_ms(overhead.token_s)} / token, prefills x {overhead.prefill_scale:.2f}, stack CPU "
            f"{_ms(overhead.request_cpu_s)} / request + {_ms(overhead.stream_cpu_s)} / token on "
            f"{overhead.host_cores:g} cores; " + ", ".join(
                f"{m} p50 " + " ".join(f"{run} {_ms(round_[run][m]['p50'])}" for run in RUNS) for m in METRICS))
    latencies = {run: _latencies(summarize(pooled[run], durations[run])) for run in RUNS}
    ratios = {f"{run}_over_real": {m: {q: latencies[run][m][q] / latencies["real"][m][q] for q in ("p50", "p99")}
                                   for m in METRICS} for run in RUNS[1:]}
    result = {"rounds": rounds, **latencies, **ratios, "tbt_by_class": {run: gap_summary(gaps[run]) for run in RUNS},
              "num_requests": len(pooled["real"]),
              "num_failed": sum(not r.ok for run in ("real", "real_again") for r in pooled[run])}
    if alone:
        real, simulated = _ttft(lone["real"]), _ttft(lone["sim"])
        result["alone"] = {"real": real, "sim": simulated, "sim_over_real": simulated / real}
    return result


def _one_at_a_time(url: str, config: ClusterConfig, engine_profile: Path, overhead, requests: list[RequestSpec],
                   model: str, seed: int) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """`requests` sent one at a time, each after the previous ended and a pause (`send_group`); and
    the simulator's records of them sent at those times."""
    async def send_each() -> list[RequestRecord]:
        async with httpx.AsyncClient(timeout=600) as http:
            t0, records = time.perf_counter(), []
            for spec in requests:
                records += await send_group(http, url, model, [spec], seed, t0)
            return records

    real = asyncio.run(send_each())
    sent = [dataclasses.replace(spec, arrival_s=record.start_s) for spec, record in zip(requests, real)]
    result = simulate(scenario_from_config(config, profiled_target(config, engine_profile, overhead)), sent)
    return real, list(result.records)


def _ttft(records: list[RequestRecord]) -> float:
    """The median TTFT of the completed requests."""
    return statistics.median(r.ttft_s for r in records if r.ok)


def _latencies(summary: dict) -> dict:
    return {m: {q: summary[m][q] for q in ("p50", "p90", "p99")} for m in METRICS}


def _reindexed(records, offset: int) -> list[RequestRecord]:
    return [dataclasses.replace(r, index=offset + i) for i, r in enumerate(records)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
