"""`splitserve profile --url`: measure what a running cluster's serving stack adds to its engine's
profiled times (`splitserve.sim.overhead`), for `splitserve sim --overhead`."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

from splitserve.config import ClusterConfig
from splitserve.placement.state import Role
from splitserve.sim.from_config import SimTarget, scenario_from_config
from splitserve.sim.overhead import (
    ServingOverhead,
    fit_overhead,
    fit_peer_slowdown,
    measure_crossed,
    measure_requests,
)

CROSSED_PROMPT_TOKENS, CROSSED_PROMPTS, CROSSED_PAUSE_S = 1024, 4, 0.3


def profiled_target(config: ClusterConfig, engine_profile: Path,
                    overhead: ServingOverhead = ServingOverhead()) -> SimTarget:
    """The simulator target of a cluster running this engine: its own model, timed by
    `engine_profile` (TP-1 pools take its rows; a pool of more ranks needs rows at its TP) plus
    `overhead`."""
    return SimTarget(config.model, 1, engine_profile, overhead=overhead)


def measure_serving_overhead(url: str, config: ClusterConfig, engine_profile: Path,
                             prompt_sizes: tuple[int, ...], output_tokens: int, repeats: int,
                             api_key: str | None = None, shared_host: bool = False) -> tuple[ServingOverhead, int]:
    """The overhead of the cluster at `url`, deployed with `config`, against `engine_profile` (a
    `splitserve profile` CSV of its hardware); and how many requests it was fitted on. With
    `shared_host` (its workers share one machine's cores) also `peer_slowdown`, when it has two
    workers to measure it between: a prompt and a token worker, or two mixed workers (the CLS puts
    the prompts on the one not decoding, whose queues are shorter)."""
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
    lone, pairs = (measure_requests(url, prompt_sizes, output_tokens, repeats, concurrency, config.model_name, api_key)
                   for concurrency in (1, 2))
    overhead = fit_overhead(lone, pairs, scenario.perf_models[prompt_hw], scenario.perf_models[token_hw],
                            scenario.transfer)
    split = Role.PROMPT in hardware and Role.TOKEN in hardware
    mixed_pair = sum(pool.count for pool in scenario.pools if pool.role is Role.MIXED) >= 2
    if not (shared_host and (split or mixed_pair)):
        return overhead, len(lone) + len(pairs)
    # the prompts' windows (request overhead + prefill) and pauses, with the decode's lone gap for
    # each token and twice the tokens for margin; the decode stays within max_model_len
    size = min(CROSSED_PROMPT_TOKENS, (limit or CROSSED_PROMPT_TOKENS + 1) - 1)
    window = overhead.request_s + scenario.perf_models[prompt_hw].prefill_time(size) + CROSSED_PAUSE_S
    gap = statistics.median(g for r in lone for g in r.tbt_s)
    tokens = min(math.ceil(2 * CROSSED_PROMPTS * window / gap), (limit or 4096) - 16)
    decode, prompts = measure_crossed(url, size, tokens, CROSSED_PROMPTS, CROSSED_PAUSE_S, config.model_name, api_key)
    overhead = replace(overhead, peer_slowdown=fit_peer_slowdown(decode, prompts))
    return overhead, len(lone) + len(pairs) + 1 + len(prompts)
