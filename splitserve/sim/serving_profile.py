"""`splitserve profile --url`: measure what a running cluster's serving stack adds to its engine's
profiled times (`splitserve.sim.overhead`), for `splitserve sim --overhead`."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from splitserve.config import ClusterConfig
from splitserve.placement.state import Role
from splitserve.sim import host_cpu
from splitserve.sim.from_config import SimTarget, scenario_from_config
from splitserve.sim.calibrate import calibrate_decode
from splitserve.sim.overhead import ServingOverhead, fit_overhead, fit_prefill, measure_requests

IDLE_WINDOW_S = 2.0  # how long the host's CPU is sampled while nothing is served
CONCURRENCY = (1, 2, 4, 8, 16)  # requests sent together: batches up to those a loaded worker runs


def profiled_target(config: ClusterConfig, engine_profile: Path,
                    overhead: ServingOverhead = ServingOverhead()) -> SimTarget:
    """The simulator target of a cluster running this engine: its own model, timed by
    `engine_profile` (TP-1 pools take its rows; a pool of more ranks needs rows at its TP) plus
    `overhead`."""
    return SimTarget(config.model, 1, engine_profile, overhead=overhead)


def measure_serving_overhead(url: str, config: ClusterConfig, engine_profile: Path,
                             prompt_sizes: tuple[int, ...], output_tokens: int, repeats: int,
                             api_key: str | None = None, shared_host: bool = False,
                             concurrency: tuple[int, ...] = CONCURRENCY) -> tuple[ServingOverhead, int]:
    """The overhead of the cluster at `url`, deployed with `config`, against `engine_profile` (a
    `splitserve profile` CSV of its hardware); and how many requests it was fitted on. With
    `shared_host` (the cluster's workers and serving stack run on this machine, with this client)
    also the host's terms, from this machine's CPU time while idle and while the requests ran.

    Requests go in groups of each `concurrency` (which holds 1 and 2), one group at a time: the
    prefill terms come from those alone, a first estimate of the decode terms from those alone and
    in pairs, and the decode terms from every group replayed in the simulator (`calibrate`)."""
    if not {1, 2} <= set(concurrency):
        raise ValueError(f"concurrency must hold 1 and 2 (requests alone and in pairs), got {concurrency!r}")
    if output_tokens < 2:
        raise ValueError(f"output_tokens must be >= 2 (the overhead is fitted on token gaps), got {output_tokens!r}")
    limit = config.engine.max_model_len
    if limit is not None and max(prompt_sizes) + output_tokens > limit:
        raise ValueError(f"prompt_sizes: {max(prompt_sizes)} + {output_tokens} output tokens exceeds the "
                         f"cluster's max_model_len={limit}")
    scenario = scenario_from_config(config, profiled_target(config, engine_profile))
    hardware = {pool.role: pool.setup for pool in scenario.pools if pool.count}
    prompt_hw = hardware.get(Role.PROMPT, hardware.get(Role.MIXED))
    token_hw = hardware.get(Role.TOKEN, hardware.get(Role.MIXED))

    def measure() -> dict[int, list]:
        return {c: measure_requests(url, prompt_sizes, output_tokens, repeats, c, config.model_name, api_key)
                for c in concurrency}

    groups, stack_s = host_cpu.stack_cpu_while(measure, IDLE_WINDOW_S) if shared_host else (measure(), 0.0)
    prompt_perf, token_perf = scenario.perf_models[prompt_hw], scenario.perf_models[token_hw]
    first = fit_overhead(groups[1], groups[2], prompt_perf, token_perf, scenario.transfer)
    if shared_host:
        records = [r for group in groups.values() for r in group]
        first = replace(first, host_cores=host_cpu.host_cores(),
                        stream_cpu_s=stream_cpu_per_token(stack_s, records, first.request_s))
    decode = calibrate_decode(replace(scenario, overhead=first), groups, first)
    return fit_prefill(groups[1], decode, prompt_perf, scenario.transfer), sum(map(len, groups.values()))


def stream_cpu_per_token(stack_s: float, records: list, request_s: float) -> float:
    """The serving stack's CPU per token streamed: `stack_s` (its CPU over `records`) less each
    request's path through it (`request_s`, run on the host), over the tokens the records got.
    Streaming a token always costs the stack CPU, so a share of none or less means the host ran
    other work while it was measured."""
    tokens = sum(r.output_tokens for r in records)
    per_token = (stack_s - len(records) * request_s) / tokens if tokens else 0.0
    if per_token <= 0:
        raise RuntimeError(f"the serving stack spent {stack_s:.2f} s of CPU on {len(records)} requests "
                           f"({tokens} tokens), no more than their paths through it ({request_s * 1000:.1f} ms "
                           "each): the host ran other work while it was measured; measure again on a quiet host")
    return per_token
