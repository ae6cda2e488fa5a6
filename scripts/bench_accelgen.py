"""AccelGen against Sarathi-Serve's fixed token budget, on the same simulated mixed pool and workload.

Both policies are the engine's own (`accelgen`, `mixed` with chunk_token_budget 512), stepped by
the simulator on the packaged Splitwise profile of Llama2-70B on DGX-H100s. The workload mixes
short prompts (the Azure conversation trace's lengths) with long ones (arxiv-summarization lengths,
--long-share of the requests), and two SLO classes, half each: tight (TBT 100 ms, TTFT 2x the
prompt's unloaded prefill, at least 0.25 s) and loose (TBT 500 ms, TTFT 5x, at least 1 s). On this
profile an iteration with any prompt work takes at least 52 ms, so a TBT much under 100 ms cannot be
met by any policy that mixes prompts with decodes.

A request attains its SLO when its TTFT and the 90th percentile of its own token gaps are within
its targets; goodput is attained requests per second of the run. Printed per offered load.

    python scripts/bench_accelgen.py [--machines 2] [--rates 4 8 12 16] [--duration-s 60] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np

from splitserve.bench.workload import RequestSpec, WorkloadSpec, make_workload
from splitserve.placement import Role
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import DEFAULT_MODEL, H100, kv_budget_tokens, perf_model
from splitserve.sim.scenario import PoolSpec, Scenario

POLICIES = ("mixed", "accelgen")
CLASSES = {"tight": (0.1, 2.0, 0.25), "loose": (0.5, 5.0, 1.0)}  # TBT s, TTFT x unloaded prefill, TTFT floor s


def workload(rate: float, duration_s: float, long_share: float, seed: int) -> list[RequestSpec]:
    """Poisson arrivals at `rate`: conversation-length prompts and a `long_share` of arxiv-length ones,
    each request in an SLO class at random."""
    count = max(1, round(rate * duration_s))
    num_long = round(count * long_share)
    short = make_workload(WorkloadSpec("conv", count - num_long, rate=rate * (1 - long_share) or None,
                                       arrivals="poisson", seed=seed)) if count > num_long else []
    long = make_workload(WorkloadSpec("arxiv", num_long, rate=rate * long_share, arrivals="poisson",
                                      seed=seed + 1, max_prompt_tokens=8192)) if num_long else []
    rng = np.random.default_rng(seed + 2)
    prefill = perf_model(DEFAULT_MODEL, H100).prefill_time
    out = []
    for index, spec in enumerate(sorted([*short, *long], key=lambda s: s.arrival_s)):
        tbt, factor, floor = CLASSES["tight" if rng.random() < 0.5 else "loose"]
        out.append(replace(spec, index=index, ttft_slo_s=max(floor, factor * prefill(spec.prompt_tokens)),
                           tbt_slo_s=tbt))
    return out


def attained(record, spec: RequestSpec) -> bool:
    if not record.ok or record.ttft_s > spec.ttft_slo_s:
        return False
    gaps = record.tbt_s
    return not gaps or float(np.percentile(gaps, 90)) <= spec.tbt_slo_s


def run(policy: str, machines: int, requests: list[RequestSpec], duration_s: float) -> dict:
    scenario = Scenario(pools=(PoolSpec(Role.MIXED, machines, H100),),
                        perf_models={H100: perf_model(DEFAULT_MODEL, H100)},
                        kv_budget_tokens=kv_budget_tokens(DEFAULT_MODEL), placement="jsq",
                        role_policies={Role.MIXED.value: policy})
    start = time.perf_counter()
    result = simulate(scenario, requests)
    by_index = {spec.index: spec for spec in requests}
    hits = {name: [] for name in CLASSES}
    for record in result.records:
        spec = by_index[record.index]
        hits["tight" if spec.tbt_slo_s == CLASSES["tight"][0] else "loose"].append(attained(record, spec))
    summary = result.summary()
    everything = hits["tight"] + hits["loose"]
    return {"policy": policy, "num_requests": len(requests),
            "attainment": sum(everything) / len(everything),
            **{f"attainment_{name}": (sum(h) / len(h) if h else None) for name, h in hits.items()},
            "goodput_rps": sum(everything) / duration_s,
            "ttft_p50_s": summary["ttft_s"]["p50"], "tbt_p99_s": summary["tbt_s"]["p99"],
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0, 16.0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"{args.machines} DGX-H100 (simulated, Llama2-70B), mixed pool; {args.duration_s:g} s of Poisson arrivals, "
          f"{args.long_share:.0%} long prompts, half tight (TBT {CLASSES['tight'][0] * 1000:g} ms) and half loose "
          f"(TBT {CLASSES['loose'][0] * 1000:g} ms) SLOs")
    print(f"{'rate':>5} {'policy':9} {'reqs':>5} {'SLO att.':>8} {'tight':>6} {'loose':>6} {'goodput':>8} "
          f"{'TTFT p50':>9} {'TBT p99':>8}")
    rows = []
    for rate in args.rates:
        requests = workload(rate, args.duration_s, args.long_share, args.seed)
        for policy in POLICIES:
            row = {"rate_rps": rate, **run(policy, args.machines, requests, args.duration_s)}
            rows.append(row)
            print(f"{rate:>5g} {policy:9} {row['num_requests']:>5} {row['attainment']:>8.1%} "
                  f"{row['attainment_tight']:>6.1%} {row['attainment_loose']:>6.1%} {row['goodput_rps']:>8.2f} "
                  f"{row['ttft_p50_s']:>9.3f} {row['tbt_p99_s']:>8.3f}", flush=True)
        base, ours = rows[-2], rows[-1]
        print(f"{'':>5} goodput accelgen / mixed: {ours['goodput_rps'] / base['goodput_rps']:.2f}x"
              if base["goodput_rps"] else f"{'':>5} mixed attains nothing at this load")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
