"""Provisioning (Splitwise IV-D): the highest request rate a cluster serves within the Table VI SLOs,
and the search for the best numbers of prompt and token machines under a power or cost budget
(iso-power, iso-cost) or the cheapest / lowest-power cluster that reaches a rate (iso-throughput).

Slowdowns are against the same request alone on one DGX-A100 (TP8), from the performance model:
TTFT0 = prefill_time(prompt), TBT0 = lone_decode_time(prompt), E2E0 = TTFT0 + TBT0 x (output - 1).
As in splitwise-sim (the simulator behind the paper's numbers), a request's TBT is its mean time
between tokens, (E2E - TTFT) / output tokens, so TBT percentiles are over requests, not token gaps;
it divides by the output length, not by its output - 1 gaps. `bench`'s per-gap TBT is stricter.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.bench.report import RequestRecord
from splitserve.bench.slo import TABLE_VI, capacity_probes
from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.jobs import Job, Runner, Search, SerialRunner
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import (
    A100,
    COST,
    DEFAULT_MODEL,
    H100,
    POWER,
    Design,
    perf_model,
)
from splitserve.sim.result import SimResult

GOALS = ("iso-power", "iso-cost", "iso-throughput")
REFERENCE_H100S = 40  # Splitwise's budgets: what 40 DGX-H100s cost or draw


@dataclass(frozen=True)
class Probe:
    """One simulated run: `design` with `num_prompt` + `num_token` machines at `rate_rps`."""

    design: str
    num_prompt: int
    num_token: int
    rate_rps: float
    num_requests: int
    meets: bool


Progress = Callable[[Probe], None]


def slowdowns(records: Sequence[RequestRecord], model: str = DEFAULT_MODEL,
              decode_rule: str = "context") -> dict[str, list[float]]:
    """TTFT, mean TBT and E2E per completed request, each over its unloaded-A100 latency (under
    the same `decode_rule` as the simulation)."""
    a100 = perf_model(model, A100, decode_rule)
    out = {"ttft": [], "tbt": [], "e2e": []}
    for r in (r for r in records if r.ok):
        ttft0, tbt0 = a100.prefill_time(r.prompt_tokens), a100.lone_decode_time(r.prompt_tokens)
        out["ttft"].append(r.ttft_s / ttft0)
        out["tbt"].append((r.e2e_s - r.ttft_s) / r.output_tokens / tbt0)
        out["e2e"].append(r.e2e_s / (ttft0 + tbt0 * (r.requested_output_tokens - 1)))
    return out


def meets_slos(result: SimResult, model: str = DEFAULT_MODEL, decode_rule: str = "context") -> bool:
    """All nine Table VI bounds hold and every request completed (none refused)."""
    if not result.records or any(not r.ok for r in result.records):
        return False
    values = slowdowns(result.records, model, decode_rule)
    for metric, bounds in TABLE_VI.items():
        for key, bound in bounds.items():
            if values[metric] and float(np.percentile(values[metric], float(key[1:]))) > bound:
                return False
    return True


@dataclass(frozen=True)
class TraceSpec:
    """Poisson arrivals for `duration_s` seconds, lengths resampled from `trace` ("code", "conv", a CSV)."""

    trace: str = "conv"
    duration_s: float = 60.0
    seed: int = 0
    model: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a positive number of seconds, got {self.duration_s!r}")

    def requests(self, rate: float):
        return make_workload(WorkloadSpec(self.trace, max(1, round(rate * self.duration_s)), rate=rate,
                                          arrivals="poisson", seed=self.seed))


def run_probe(design: Design, num_prompt: int, num_token: int, rate: float, trace: TraceSpec) -> Probe:
    requests = trace.requests(rate)
    result = simulate(design.scenario(num_prompt, num_token, trace.model), requests)
    return Probe(design.name, num_prompt, num_token, rate, len(requests),
                 meets_slos(result, trace.model, design.decode_rule))


def max_throughput(design: Design, num_prompt: int, num_token: int, trace: TraceSpec, low: float, high: float,
                   iterations: int = 5, progress: Progress | None = None, runner: Runner | None = None) -> float:
    """The highest Poisson rate (req/s) in [low, high] meeting the SLOs, by geometric bisection
    (`splitserve.bench.slo.capacity_probes`), within a factor (high / low) ** (1 / 2**iterations)
    below the true one: 0.0 if `low` fails, `high` if `high` passes."""
    search_ = throughput_search(design, num_prompt, num_token, trace, low, high, iterations)
    return (runner or SerialRunner()).drive([search_], progress)[0][0]


def throughput_search(design: Design, num_prompt: int, num_token: int, trace: TraceSpec, low: float, high: float,
                      iterations: int = 5) -> Search:
    """`max_throughput` as a search (splitserve.jobs): each probe a job; returns (rate, probes)."""
    return capacity_probes(lambda rate: Job(run_probe, (design, num_prompt, num_token, rate, trace)),
                           lambda probe: probe.meets, low, high, iterations, geometric=True)


def reference_budget(goal: str) -> float:
    """Splitwise's budget for `goal`: the power or cost of 40 DGX-H100s (1760 or 190.4)."""
    return REFERENCE_H100S * _unit(goal)[H100]


def _unit(goal: str) -> dict[str, float]:
    """Per-machine constants of a budget goal: POWER for iso-power, COST for iso-cost."""
    constants = {"iso-power": POWER, "iso-cost": COST}
    if goal not in constants:
        raise ValueError(f"goal must be iso-power or iso-cost for a budget, got {goal!r}")
    return constants[goal]


def budget_splits(design: Design, goal: str, budget: float, step: int = 5) -> list[tuple[int, int]]:
    """The (prompt, token) machine counts that fill `budget` (summary's formulas, e.g. iso-power
    A100 = int(44 x (40 - H) // 24.8)). Baselines: one count. Same hardware in both pools: the
    token count steps (step, 2 step, ...) and prompt machines take the rest; otherwise the
    prompt count steps and token machines take the rest. Only splits with both counts >= 1 (a
    baseline's count >= 1); a budget that leaves none is an error, not an empty plan."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step!r}")
    unit = _unit(goal)
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a positive number, got {budget!r}")
    p_unit, t_unit = unit[design.prompt_hw], unit[design.token_hw]
    if design.baseline:
        splits = [(_fit(budget, p_unit), 0)]
    elif design.prompt_hw == design.token_hw:
        splits = [(_fit(budget - t * t_unit, p_unit), t) for t in range(step, _fit(budget, t_unit) + 1, step)]
    else:
        splits = [(p, _fit(budget - p * p_unit, t_unit)) for p in range(step, _fit(budget, p_unit) + 1, step)]
    splits = [(p, t) for p, t in splits if p >= 1 and (t >= 1 or design.baseline)]
    if not splits:
        needs = "machine" if design.baseline else "split with both counts >= 1"
        raise ValueError(f"budget {budget!r} at step {step} leaves no {needs} ({goal} of {design.name})")
    return splits


def _fit(budget: float, unit: float) -> int:
    """Whole machines of `unit` within `budget` (a tiny tolerance absorbs float error: 1540/44 is 35)."""
    return max(0, math.floor(budget / unit + 1e-9))


@dataclass(frozen=True)
class Goal:
    """iso-power / iso-cost: the split with the highest throughput within `budget` (default: 40
    H100s). iso-throughput: the cheapest (`minimize` "cost") or lowest-power ("power") split,
    on a `step` grid up to `budget` of that kind, that serves `target_rps` within the SLOs."""

    kind: str = "iso-power"
    budget: float | None = None
    target_rps: float | None = None
    minimize: str = "cost"
    step: int = 5

    def __post_init__(self) -> None:
        if self.kind not in GOALS:
            raise ValueError(f"kind must be one of {', '.join(GOALS)}, got {self.kind!r}")
        if self.kind == "iso-throughput" and not (self.target_rps and math.isfinite(self.target_rps)
                                                  and self.target_rps > 0):
            raise ValueError(f"target_rps must be a finite number > 0 for iso-throughput, got {self.target_rps!r}")
        if self.minimize not in ("cost", "power"):
            raise ValueError(f"minimize must be cost or power, got {self.minimize!r}")
        if self.step < 1:
            raise ValueError(f"step must be >= 1, got {self.step!r}")

    @property
    def budget_kind(self) -> str:
        return "iso-" + self.minimize if self.kind == "iso-throughput" else self.kind

    @property
    def resolved_budget(self) -> float:
        return self.budget if self.budget is not None else reference_budget(self.budget_kind)


@dataclass(frozen=True)
class Config:
    """One evaluated split: its cost, power and throughput (iso-throughput: the target if it meets it, else 0)."""

    num_prompt: int
    num_token: int
    cost: float
    power: float
    throughput_rps: float


@dataclass(frozen=True)
class Plan:
    design: str
    goal: Goal
    trace: TraceSpec
    configs: tuple[Config, ...]  # in evaluation order
    best: Config | None          # None: nothing met the SLOs
    decode_rule: str
    mixed_policy: str


def search(design: Design, goal: Goal, trace: TraceSpec, iterations: int = 5,
           progress: Progress | None = None, runner: Runner | None = None) -> Plan:
    """Evaluate the splits of `goal` and pick the best (see `Goal`); `runner` says where the
    simulations run (default: one after another here). The plan does not depend on it."""
    runner = runner or SerialRunner()
    if goal.kind == "iso-throughput":
        return _iso_throughput(design, goal, trace, runner, progress)
    splits = budget_splits(design, goal.kind, goal.resolved_budget, goal.step)
    found = runner.drive([throughput_search(design, p, t, trace, *rate_range(p + t), iterations) for p, t in splits],
                         progress)
    configs = [Config(p, t, design.cost(p, t), design.power(p, t), rate) for (p, t), (rate, _) in zip(splits, found)]
    passing = [c for c in configs if c.throughput_rps > 0]
    best = max(passing, key=lambda c: (c.throughput_rps, -c.cost)) if passing else None
    return Plan(design.name, goal, trace, tuple(configs), best, design.decode_rule, design.mixed_policy)


def rate_range(machines: int) -> tuple[float, float]:
    """Where to look for a cluster's throughput: 0.5 to 12 req/s per machine (a DGX-H100 serves
    about 5 conversation requests/s within the SLOs in our simulator)."""
    return 0.5 * machines, 12.0 * machines


def staircase(design: Design, goal: Goal, meets: Callable[[int, int], bool],
              upcoming: Callable[[list[tuple[int, int]]], None] | None = None) -> Config | None:
    """iso-throughput: the cheapest (or lowest-power) split on the `step` grid (counts from 1) within
    the budget for which `meets(num_prompt, num_token)`, or None. `upcoming(splits)` hears, before
    each prompt count, the splits the walk may probe next, in the order it would (to run ahead).

    More machines of either kind should never break an SLO, so the smallest passing token count can
    only fall as the prompt count grows: a walk down that staircase (ascending prompt counts, each
    from the previous count's smallest passing token count) probes each count's top and then steps
    down while it passes, at most (prompt counts x 2 + token counts) probes. It stops once one more
    prompt machine alone costs more than the best found. Baselines: the smallest passing count."""
    unit, budget = _unit(goal.budget_kind), goal.resolved_budget
    spend = design.power if goal.minimize == "power" else design.cost
    p_unit, t_unit = unit[design.prompt_hw], unit[design.token_hw]
    best: tuple[int, int] | None = None
    known: int | None = None  # the smallest passing token count of the last prompt count that passed
    prompt_counts = range(1, _fit(budget, p_unit) + 1, goal.step)
    for p in prompt_counts:
        if best is not None and spend(p, 0 if design.baseline else 1) >= spend(*best):
            break
        if design.baseline:
            if upcoming is not None:
                upcoming([(q, 0) for q in prompt_counts if q >= p])
            if meets(p, 0):
                return _config(design, goal, p, 0)
            continue
        counts = [t for t in range(1, _fit(budget - p * p_unit, t_unit) + 1, goal.step) if known is None or t <= known]
        if upcoming is not None:
            upcoming([(p, t) for t in reversed(counts)])
        if not counts or not meets(p, counts[-1]):
            continue
        i = len(counts) - 1
        while i > 0 and meets(p, counts[i - 1]):
            i -= 1
        known = counts[i]
        if best is None or (spend(p, known), p + known) < (spend(*best), sum(best)):
            best = (p, known)
    return _config(design, goal, *best) if best is not None else None


def _config(design: Design, goal: Goal, num_prompt: int, num_token: int) -> Config:
    return Config(num_prompt, num_token, design.cost(num_prompt, num_token), design.power(num_prompt, num_token),
                  goal.target_rps)


def _iso_throughput(design: Design, goal: Goal, trace: TraceSpec, runner: Runner,
                    progress: Progress | None) -> Plan:
    """The staircase walk; with a parallel runner, a probe the walk needs runs together with the
    next ones it may need (as many as the runner has slots), and the walk reads them as it goes.
    `configs` are the probes the walk read, in its order, so serial and parallel plans are equal."""
    configs, found = [], {}
    ahead: list[tuple[int, int]] = []

    def upcoming(splits: list[tuple[int, int]]) -> None:
        ahead[:] = splits

    def meets(p: int, t: int) -> bool:
        if (p, t) not in found:
            later = ahead[ahead.index((p, t)) + 1:] if (p, t) in ahead else []
            batch = [(p, t)] + [s for s in later if s not in found][:runner.slots - 1]
            probes = runner.map([Job(run_probe, (design, *s, goal.target_rps, trace)) for s in batch], progress)
            found.update(zip(batch, probes))
        passed = found[p, t].meets
        configs.append(Config(p, t, design.cost(p, t), design.power(p, t), goal.target_rps if passed else 0.0))
        return passed

    best = staircase(design, goal, meets, upcoming)
    return Plan(design.name, goal, trace, tuple(configs), best, design.decode_rule, design.mixed_policy)
