"""The decode terms of a serving overhead (`iteration_s`, `token_s`), fitted by replaying the
measured requests in the simulator.

The first estimate (`overhead.fit_overhead`) reads requests alone and in pairs as one worker
decoding one and two sequences. That holds for one token worker, not for mixed workers (placement
spreads a pair over two workers, which then share the host's cores with the stack), and two points
say nothing of larger batches: on CPU the per-token cost falls as batches grow (a worker at batch 16
spends about a quarter of what batch 1 to 2 suggests), so a line through them overcharges every loaded
iteration. Here the simulator replays each group of concurrent requests as it was sent, on the
cluster's own pools, placement and shared host, and the two terms are the least-squares fit (over
the relative error of each concurrency's median token gap) that makes its gaps the measured ones.
A trial that overloads the simulated cluster (groups overlap, requests are refused) counts as an
infinite error: the step that reached it is halved until the error falls.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

from splitserve.bench.report import RequestRecord
from splitserve.bench.workload import RequestSpec
from splitserve.sim.cluster import simulate
from splitserve.sim.overhead import ServingOverhead
from splitserve.sim.scenario import Scenario

STEP_S = 1e-4        # the finite difference of each term, seconds
MAX_ROUNDS = 12
TOLERANCE_S = 1e-6   # a round that moves both terms less than this ends the fit
DAMPING = 1e-3       # Levenberg-Marquardt, relative: keeps the step finite where one batch size cannot separate the terms
MAX_HALVINGS = 8     # of a step that does not lower the squared error


def calibrate_decode(scenario: Scenario, groups: dict[int, list[RequestRecord]],
                     overhead: ServingOverhead) -> ServingOverhead:
    """`overhead` with `iteration_s` and `token_s` refitted so that `scenario` (the cluster, with
    `overhead`'s other terms) gives every concurrency's median token gap in `groups` (records of
    groups of that many requests sent together, one group at a time, in sending order)."""
    requests, levels = _replay(groups)

    def errors(terms: tuple[float, float]) -> list[float]:
        trial = replace(scenario, overhead=replace(overhead, iteration_s=terms[0], token_s=terms[1]))
        records = simulate(trial, requests).records
        return [_median_gap(records[i] for i in span) / target - 1.0 for target, span in levels]

    terms = (overhead.iteration_s, overhead.token_s)
    base = errors(terms)
    if not _finite(base):
        raise ValueError(f"the simulated cluster refuses requests of the measured groups at the first estimate "
                         f"(iteration_s={terms[0]:.6f}, token_s={terms[1]:.6f}): nothing to fit from")
    for _ in range(MAX_ROUNDS):
        columns = [[(e - b) / STEP_S for e, b in zip(errors(moved), base)]
                   for moved in ((terms[0] + STEP_S, terms[1]), (terms[0], terms[1] + STEP_S))]
        if not all(map(_finite, columns)):  # a probe overloads the simulated cluster: no slope to follow
            break
        step = _solve(columns, base)
        for _ in range(MAX_HALVINGS):
            trial = (max(0.0, terms[0] + step[0]), max(0.0, terms[1] + step[1]))
            trial_errors = errors(trial)
            if _cost(trial_errors) <= _cost(base):
                break
            step = (step[0] / 2, step[1] / 2)
        else:  # no step along this direction lowers the error: `terms` is the fit
            break
        moved = max(abs(a - b) for a, b in zip(trial, terms))
        terms, base = trial, trial_errors
        if moved < TOLERANCE_S:
            break
    return replace(overhead, iteration_s=terms[0], token_s=terms[1])


def _replay(groups: dict[int, list[RequestRecord]]) -> tuple[list[RequestSpec], list[tuple[float, range]]]:
    """The groups as simulator requests (indexes in sending order), each group arriving after the
    one before has long ended; and per concurrency, the measured median gap and its requests' indexes."""
    requests, levels, start = [], [], 0.0
    for concurrency, records in sorted(groups.items()):
        if not records or len(records) % concurrency or not all(r.ok and len(r.tbt_s) >= 1 for r in records):
            raise ValueError(f"concurrency {concurrency}: expected whole groups of completed requests of >= 2 tokens")
        gap = _median_gap(records)
        if gap <= 0:  # the fit's errors are relative to it
            raise ValueError(f"concurrency {concurrency}: the measured median token gap is 0 (the tokens arrived "
                             "in one chunk, not one by one); nothing to fit from")
        levels.append((gap, range(len(requests), len(requests) + len(records))))
        for first in range(0, len(records), concurrency):
            group = records[first:first + concurrency]
            requests += [RequestSpec(len(requests) + i, start, r.prompt_tokens, r.output_tokens)
                         for i, r in enumerate(group)]
            start += 2 * max(r.e2e_s for r in group) + 1.0  # the simulated group ends well within this
    return requests, levels


def _median_gap(records) -> float:
    """The median over requests of each one's median token gap; a refused request's is infinite."""
    return statistics.median(statistics.median(r.tbt_s) if r.ok and r.tbt_s else math.inf for r in records)


def _cost(errors: list[float]) -> float:
    return sum(e * e for e in errors)


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _solve(columns: list[list[float]], errors: list[float]) -> tuple[float, float]:
    """The damped least-squares step x of a two-column Jacobian J: (JᵀJ + λ·diag(JᵀJ)) x = -Jᵀe."""
    u, v = columns
    uu, uv, vv = _dot(u, u) * (1 + DAMPING), _dot(u, v), _dot(v, v) * (1 + DAMPING)
    gu, gv = -_dot(u, errors), -_dot(v, errors)
    det = uu * vv - uv * uv
    if det <= 0:  # neither term moves the gaps: nothing to fit
        return 0.0, 0.0
    return (vv * gu - uv * gv) / det, (uu * gv - uv * gu) / det


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))
