"""`splitserve profile --url`: measure what a running cluster's serving stack adds to its engine's
profiled times (`splitserve.sim.overhead`), for `splitserve sim --overhead`."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from splitserve.config import ClusterConfig
from splitserve.placement.state import Role
from splitserve.sim import host_cpu
from splitserve.sim.from_config import SimTarget, scenario_from_config
from splitserve.sim.calibrate import calibrate_decode
from splitserve.sim.overhead import GROUP_PAUSE_S, ServingOverhead, fit_overhead, fit_prefill, measure_requests

SAMPLE_INTERVAL_S = 0.02  # the host's CPU is sampled this often while the requests run
IDLE_S = 0.8 * GROUP_PAUSE_S  # the end of each group's pause: the stack idle, the last group's teardown done
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
    also the host's terms, from this machine's CPU time sampled while the requests ran
    (`stack_cpu`).

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

    groups, trace = host_cpu.trace_while(measure, SAMPLE_INTERVAL_S) if shared_host else (measure(), None)
    prompt_perf, token_perf = scenario.perf_models[prompt_hw], scenario.perf_models[token_hw]
    first = fit_overhead(groups[1], groups[2], prompt_perf, token_perf)
    stack = stack_cpu(trace, groups) if shared_host else None
    if stack:
        first = replace(first, host_cores=host_cpu.host_cores(), **stack.terms(first.request_s))
    decode = calibrate_decode(replace(scenario, overhead=first), groups, first)
    fitted = fit_prefill(groups[1], decode, prompt_perf)
    return (replace(fitted, **stack.terms(fitted.request_s)) if stack else fitted), sum(map(len, groups.values()))


@dataclass(frozen=True)
class StackCpu:
    """What the serving stack spent while the overhead's requests ran, its idle rate taken off."""
    path_s: float      # a lone request's, from send to first token (median)
    spent_s: float     # over the windows of every group
    requests: int
    tokens: int

    def terms(self, request_s: float) -> dict[str, float]:
        """request_cpu_s (the path's CPU, at most `request_s`: it is part of the path's time) and
        stream_cpu_s (what the windows spent beyond the paths, per token). Streaming always costs the
        stack CPU, so none left means the host ran other work while it was measured."""
        request_cpu = min(request_s, max(0.0, self.path_s))
        per_token = (self.spent_s - self.requests * request_cpu) / self.tokens
        if per_token <= 0:
            raise RuntimeError(f"the serving stack spent {self.spent_s:.2f} s of CPU on {self.requests} requests "
                               f"({self.tokens} tokens), no more than their paths to the workers "
                               f"({request_cpu * 1000:.1f} ms each): the host ran other work while it was measured; "
                               "measure again on a quiet host")
        return {"request_cpu_s": request_cpu, "stream_cpu_s": per_token}


def stack_cpu(trace: host_cpu.StackTrace, groups: dict[int, list]) -> StackCpu:
    """The stack's CPU read off `trace` (the host's CPU outside the workers while `groups` ran: per
    concurrency c, records sent c at a time, start_s on time.perf_counter()'s clock). Its idle rate
    is read over the last IDLE_S of the pause before each group and taken off every window."""
    windows = [(min(r.start_s for r in group), max(r.start_s + r.e2e_s for r in group), group)
               for c, records in groups.items() for group in (records[i:i + c] for i in range(0, len(records), c))]
    idle = sum(trace.between(start - IDLE_S, start) for start, _, _ in windows) / (IDLE_S * len(windows))
    paths = [trace.between(r.start_s, r.start_s + r.ttft_s) - idle * r.ttft_s for r in groups[1]]
    return StackCpu(statistics.median(paths), sum(trace.between(start, end) - idle * (end - start)
                                                  for start, end, _ in windows),
                    sum(len(g) for *_, g in windows), sum(r.output_tokens for *_, g in windows for r in g))
