"""`splitserve sim`: replay a trace through a simulated cluster, given by the same config file a
deployment uses or by one of Splitwise's designs at a machine count, and write the same report a
real `splitserve bench` run writes (--out) or its summary alone (--json).

    splitserve sim --config deploy/splitwise-ha.yaml --trace conv --rate 40 --num-requests 5000 --out sim/
    splitserve sim --trace conv --rate 2 --length-scale 0.25 --profile cpu.csv --model demo --out sim/  # local-cpu
    splitserve sim ... --profile cpu.csv --overhead overhead.json  # + what `splitserve profile --url` measured
    splitserve sim --design splitwise-hh --prompt-machines 25 --token-machines 15 --trace conv --rate 70 \
        --duration 120 --json hh.json  # a Splitwise design (DGX machines, the packaged A100/H100 profiles)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from splitserve.bench.report import markdown_table, write_outputs
from splitserve.bench.workload import ARRIVALS, WorkloadSpec, make_workload, parse_priorities
from splitserve.command import report_errors
from splitserve.engine.engine_config import KV_HOST_WRITE_POLICIES
from splitserve.placement.state import ADAPTER_WAITS
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import DECODE_RULES, DESIGNS, MIXED_POLICIES, design
from splitserve.sim.drafts import DraftModel
from splitserve.sim.host_kv import DEFAULT_WRITE_THROUGH, HOST_LINK_BYTES_PER_S, HostKVModel
from splitserve.sim.overhead import ServingOverhead
from splitserve.sim.scenario import Scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    cluster = p.add_mutually_exclusive_group()
    cluster.add_argument("--config", help="a Serve config (deploy/*.yaml) or bare cluster config; default: local-cpu")
    cluster.add_argument("--design", choices=list(DESIGNS), help="one of Splitwise's designs instead of a config")
    p.add_argument("--prompt-machines", type=int, default=None,
                   help="--design: prompt machines (a baseline's machines, all mixed)")
    p.add_argument("--token-machines", type=int, default=0, help="--design: token machines (0 for a baseline)")
    p.add_argument("--decode-rule", choices=DECODE_RULES, default=DECODE_RULES[0],
                   help="--design: each decode pays for its context (ours) or splitwise-sim's rule")
    p.add_argument("--mixed-policy", choices=MIXED_POLICIES, default=MIXED_POLICIES[0],
                   help="--design: how mixed machines batch (orca: the paper's mixed continuous batching)")
    p.add_argument("--model", default="llama2-70b", help="whose profiles stand in for the workers: llama2-70b, "
                                                         "bloom-176b, or demo / a checkpoint with --profile")
    p.add_argument("--tensor-parallel", type=int, default=8,
                   help="the TP whose profile rows stand in for a pool of tensor_parallel_size 1 (a worker is a "
                        "TP-N machine); a pool with its own tensor_parallel_size uses the rows at that TP")
    p.add_argument("--profile", type=Path, default=None, help="a `splitserve profile` CSV for other hardware classes")
    p.add_argument("--bandwidth-gbps", type=float, default=400.0, help="KV transfer link between machines")
    p.add_argument("--overhead", type=Path, default=None,
                   help="the serving stack's overhead measured by `splitserve profile --url` (a JSON file); "
                        "host_cores in it put every worker on one host shared with the serving stack")
    p.add_argument("--trace", default="conv", help="code, conv, sharegpt, arxiv, mooncake or a file, as for bench; "
                                                   "a Mooncake trace gives lengths, arrivals and shared prefix blocks "
                                                   "(the workers' prefix caches hit them)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals at --rate (instead of --num-requests)")
    p.add_argument("--rate", type=float, default=None, help="mean requests/s (default: the trace's own)")
    p.add_argument("--arrivals", choices=ARRIVALS, default=None)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--prefix-blind", action="store_true",
                   help="place blind to the workers' prefix caches and ship every prompt's whole KV (traces with "
                        "shared prefix blocks, e.g. mooncake, are prefix-aware by default)")
    p.add_argument("--prefix-index-blocks", type=int, default=None,
                   help="(worker, block) entries the CLS's prefix index keeps at most (default: the scenario's)")
    p.add_argument("--prefill-saved-weight", type=float, default=None,
                   help="prompt-queue tokens one cached prompt token saves a prompt or mixed worker, in prefix-aware "
                        "placement (default: the config's scheduler.prefill_saved_weight, 1)")
    p.add_argument("--transfer-saved-weight", type=float, default=None,
                   help="token-queue tokens one cached prompt token saves a token worker (default: the config's "
                        "scheduler.transfer_saved_weight, 1)")
    p.add_argument("--session-fraction", type=float, default=1.0,
                   help="trace arrivals with prefix blocks (mooncake): this fraction of the conversations, as for bench")
    add_worker_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for requests.jsonl, summary.json, report.md, workers.json")
    p.add_argument("--json", type=Path, default=None, help="write the summary alone here (latency percentiles, "
                                                            "num_requests, wall_time_s)")
    p.add_argument("--no-progress", action="store_true")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """What the workers run besides the scenario's engine: adapters, priorities, drafts, a host tier."""
    p.add_argument("--num-adapters", type=int, default=0,
                   help="requests run under this many LoRA adapters, drawn by --adapter-zipf (the workers need "
                        "slots: --max-loras, or engine.max_loras in --config)")
    p.add_argument("--adapter-zipf", type=float, default=0.0, help="the k-th adapter is drawn with weight "
                                                                   "1 / (k + 1) ** this (0: uniform)")
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots per worker (default: the scenario's)")
    p.add_argument("--lora-swap-ms", type=float, default=0.0, help="what writing an adapter into a slot adds to "
                                                                     "the iteration that admits it")
    p.add_argument("--lora-blind", action="store_true", help="place blind to which adapters the slots hold")
    p.add_argument("--priority-mix", default="", metavar="P:SHARE,...",
                   help="priority classes, as for bench (e.g. 0:0.2,1:0.8); the summary gives each class's latencies")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="the engines' (default: the scenario's; priority: lower values first, preempting higher)")
    p.add_argument("--speculative-tokens", type=int, default=None, help="drafts a decode checks a step "
                   "(default: the config's engine.num_speculative_tokens; 0: none): needs --draft-kept-share")
    p.add_argument("--draft-kept-share", type=float, default=None, help="drafts kept / drafts checked, as a "
                   "cluster's /metrics count them (splitserve_spec_decode_accepted_tokens_total / draft_tokens_total)")
    p.add_argument("--kv-host-gib", type=float, default=None, help="each worker's host memory for the prefix "
                   "cache's evicted blocks (default: the config's engine.kv_host_cache_bytes; 0: none)")
    p.add_argument("--kv-host-write-policy", choices=KV_HOST_WRITE_POLICIES, default=None,
                   help="when the host tier copies a block out (default: the config's engine.kv_host_write_policy, "
                        "write_through): once it is computed (on its own stream), or as the KV cache evicts it")
    p.add_argument("--kv-host-gbps", type=float, default=HOST_LINK_BYTES_PER_S / 1e9,
                   help="GB/s a worker's copies between host memory and its GPUs move, every GPU's link together "
                        "(assumed: a DGX-H100's 8 PCIe Gen5 x16 links; one GPU: 50)")


def scenario_of(args) -> Scenario:
    """The scenario the arguments describe, with its drafts (`drafts_of`)."""
    configured, scenario = scenario_and_speculation(args)
    return with_host_kv(args, replace(scenario, drafts=drafts_of(args, configured)))


def with_host_kv(args, scenario: Scenario) -> Scenario:
    """The host tier: --kv-host-gib a worker whatever its TP, else the config's, copied at --kv-host-gbps,
    written as --kv-host-write-policy, else as the config says."""
    configured = scenario.host_kv
    if args.kv_host_write_policy is not None:
        through = args.kv_host_write_policy == "write_through"
    else:
        through = configured.write_through if configured is not None else DEFAULT_WRITE_THROUGH
    if args.kv_host_gib is None:
        tokens = configured.tokens if configured is not None else 0
    elif math.isfinite(args.kv_host_gib) and args.kv_host_gib >= 0:
        tokens = int(args.kv_host_gib * 2**30 // scenario.transfer.kv_bytes_per_token)
        scenario = replace(scenario, pools=tuple(replace(pool, host_kv_tokens=None) for pool in scenario.pools))
    else:
        raise ValueError(f"--kv-host-gib must be a finite number >= 0, got {args.kv_host_gib!r}")
    return replace(scenario, host_kv=HostKVModel(tokens, args.kv_host_gbps * 1e9, through) if tokens else None)


def drafts_of(args, configured: int) -> DraftModel | None:
    """Speculative decoding: --speculative-tokens, else what the config runs, at --draft-kept-share."""
    k = configured if args.speculative_tokens is None else args.speculative_tokens
    share = args.draft_kept_share
    if k == 0:
        if share is not None:
            raise ValueError("--draft-kept-share: no speculative decoding to keep drafts of (--speculative-tokens, "
                             "or engine.num_speculative_tokens in --config)")
        return None
    if share is None:
        raise ValueError(f"{k} speculative tokens a step: give --draft-kept-share, the share of drafts kept "
                         "(a cluster's /metrics: splitserve_spec_decode_accepted_tokens_total / draft_tokens_total)")
    return DraftModel(k, share)


def scenario_and_speculation(args) -> tuple[int, Scenario]:
    """The scenario of --config or --design, and the speculative tokens its engines run."""
    if args.design is None:
        # imported here: a cluster config brings in the engine's checkpoint loader and with it torch
        # (200 MB), which a Splitwise design does not need
        from splitserve.config import ClusterConfig, load_cluster_config
        from splitserve.sim.from_config import SimTarget, scenario_from_config

        config = load_cluster_config(args.config)[0] if args.config else ClusterConfig()
        overhead = ServingOverhead.load(args.overhead) if args.overhead else ServingOverhead()
        target = SimTarget(args.model, args.tensor_parallel, args.profile, args.bandwidth_gbps, overhead=overhead)
        return config.engine.num_speculative_tokens, scenario_from_config(config, target)
    if args.prompt_machines is None:
        raise ValueError("--prompt-machines is required with --design")
    chosen = replace(design(args.design), decode_rule=args.decode_rule, mixed_policy=args.mixed_policy)
    return 0, chosen.scenario(args.prompt_machines, args.token_machines, args.model)


def num_requests(args) -> int:
    if args.duration is None:
        return args.num_requests
    if args.rate is None or not args.duration > 0:
        raise ValueError(f"--duration needs --rate and a positive number of seconds, got {args.duration!r}")
    count = args.rate * args.duration
    if not math.isfinite(count):
        raise ValueError(f"--rate x --duration must be a finite number of requests, got {count!r}")
    return max(1, round(count))


def with_prefix(args, scenario: Scenario) -> Scenario:
    """Prefix-aware placement as the flags given say (--prefix-blind, the index's size, the weights
    of what a cached token saves), else as the scenario has it."""
    flags = {"aware": False if args.prefix_blind else None, "max_index_blocks": args.prefix_index_blocks,
             "prefill_saved_weight": args.prefill_saved_weight, "transfer_saved_weight": args.transfer_saved_weight}
    given = {name: value for name, value in flags.items() if value is not None}
    return replace(scenario, prefix=replace(scenario.prefix, **given)) if given else scenario


def run(args) -> dict:
    if args.out is None and args.json is None:
        raise ValueError("give --out (the full report) or --json (the summary), or both")
    scenario = with_prefix(args, scenario_of(args))
    if args.scheduling_policy is not None:
        scenario = replace(scenario, scheduling_policy=args.scheduling_policy)
    scenario = replace(scenario, lora_swap_s=args.lora_swap_ms / 1000,
                       max_loras=scenario.max_loras if args.max_loras is None else args.max_loras,
                       adapters=replace(scenario.adapters, aware=not args.lora_blind))
    requests = make_workload(WorkloadSpec(trace=args.trace, num_requests=num_requests(args), rate=args.rate,
                                          arrivals=args.arrivals, length_scale=args.length_scale, seed=args.seed,
                                          session_fraction=args.session_fraction,
                                          max_prompt_tokens=scenario.max_model_len // 2,
                                          max_output_tokens=scenario.max_model_len // 2,
                                          adapters=tuple(f"lora-{k}" for k in range(args.num_adapters)),
                                          adapter_zipf=args.adapter_zipf,
                                          priorities=parse_priorities(args.priority_mix)))
    started = time.perf_counter()
    with tqdm(total=len(requests), desc="simulated", unit="req", disable=args.no_progress, leave=False) as bar:
        result = simulate(scenario, requests, args.seed, progress=lambda done, _: bar.update(done - bar.n))
    wall = time.perf_counter() - started
    summary = {**result.summary(), "simulated_s": result.duration_s, "wall_time_s": wall,
               "simulated_requests_per_wall_s": len(requests) / wall,
               "prefill_tokens_computed": sum(w.prefill_tokens for w in result.workers),
               "kv_tokens_sent": result.kv_tokens_sent, "kv_tokens_reused": result.kv_tokens_reused,
               "placements_refused": result.placements_refused,
               "lora_swaps": sum(w.lora_swaps for w in result.workers),
               "draft_tokens": sum(w.draft_tokens for w in result.workers),
               "accepted_tokens": sum(w.accepted_tokens for w in result.workers),
               "host_restored_tokens": sum(w.host_restored_tokens for w in result.workers),
               "lora_placements": dict(zip(ADAPTER_WAITS, result.adapter_placements))}
    if args.out:
        out = Path(args.out)
        write_outputs(out, result.records, summary, f"simulated: {args.trace}")
        (out / "workers.json").write_text(json.dumps([asdict(w) for w in result.workers], indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown_table(summary))
    print(f"{len(requests)} requests, {result.duration_s:.0f} s simulated in {wall:.1f} s; "
          f"results in {', '.join(str(p) for p in (args.out, args.json) if p)}")
    return summary


def run_command(args) -> int:
    return report_errors("sim", run, args, (ValueError, OSError, ValidationError))
