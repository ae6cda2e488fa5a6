"""`splitserve plan`: search the prompt / token machine counts of one design (Splitwise IV-D) and
write plan.json and a heat map of the (prompt, token) design space (Splitwise Fig. 12). Its
simulations run as Ray tasks (a local Ray using every core, or a cluster's with --address) or, with
--serial, one after another here; the plan is the same either way. The runner comes from
`args.make_runner` (the CLI's: Ray is the cluster layer's to start, not this one's)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from splitserve.bench.plots import MISSING, new_figure, plots_available
from splitserve.jobs import add_runner_arguments
from splitserve.provision.search import GOALS, Goal, Plan, TraceSpec, search
from splitserve.sim.designs import DECODE_RULES, DEFAULT_MODEL, DESIGNS, MIXED_POLICIES, design
from splitserve.sim.perf_model import MODEL_SHAPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--design", required=True, choices=list(DESIGNS))
    p.add_argument("--trace", default="conv", help="code, conv or a CSV of lengths (Poisson arrivals)")
    p.add_argument("--goal", default="iso-power", choices=GOALS)
    p.add_argument("--budget", type=float, default=None,
                   help="power or cost units (default: 40 DGX-H100s: power 1760, cost 190.4)")
    p.add_argument("--target-rps", type=float, default=None, help="iso-throughput: the rate to reach")
    p.add_argument("--minimize", default="cost", choices=("cost", "power"), help="iso-throughput: what to minimise")
    p.add_argument("--step", type=int, default=5, help="machine-count step of the enumeration")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of Poisson arrivals per run")
    p.add_argument("--iterations", type=int, default=5, help="bisection steps of each throughput search")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODEL_SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-rule", choices=DECODE_RULES, default=DECODE_RULES[0],
                   help="each decode pays for its context (ours) or splitwise-sim's rule")
    p.add_argument("--mixed-policy", choices=MIXED_POLICIES, default=MIXED_POLICIES[0],
                   help="how mixed machines batch (orca: the paper's mixed continuous batching)")
    p.add_argument("--out", default=None, help="directory for plan.json and design_space.png")
    add_runner_arguments(p)


def run_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        goal = Goal(args.goal, args.budget, args.target_rps, args.minimize, args.step)
        trace = TraceSpec(args.trace, args.duration_s, args.seed, args.model)
        chosen = dataclasses.replace(design(args.design), decode_rule=args.decode_rule, mixed_policy=args.mixed_policy)
        runner = args.make_runner(args)
        with tqdm(desc=f"plan {args.design}", unit="run") as bar:
            plan = search(chosen, goal, trace, args.iterations,
                          lambda probe: bar.update() or bar.set_postfix(P=probe.num_prompt, T=probe.num_token,
                                                                        rps=round(probe.rate_rps, 1)), runner)
    except (ValueError, OSError) as error:
        print(f"splitserve plan: {error}", file=sys.stderr)
        return 2
    print(table(plan))
    if args.out:
        for path in write_outputs(plan, args.out):
            print(f"wrote {path}")
    return 0


def plan_dict(plan: Plan) -> dict:
    as_dict = dataclasses.asdict
    return {"design": plan.design, "decode_rule": plan.decode_rule, "mixed_policy": plan.mixed_policy,
            "goal": {**as_dict(plan.goal), "budget": plan.goal.resolved_budget},
            "trace": as_dict(plan.trace), "configs": [as_dict(c) for c in plan.configs],
            "best": as_dict(plan.best) if plan.best else None}


def table(plan: Plan) -> str:
    lines = [(f"{plan.design}, {plan.goal.kind} (budget {plan.goal.resolved_budget:g}), trace {plan.trace.trace}, "
             f"{plan.trace.duration_s:g} s runs"),
             f"{'prompt':>6} {'token':>6} {'cost':>8} {'power':>8} {'rps':>8}"]
    for c in plan.configs:
        mark = "  <- best" if c == plan.best else ""
        lines.append(f"{c.num_prompt:>6} {c.num_token:>6} {c.cost:>8.2f} {c.power:>8.1f} {c.throughput_rps:>8.2f}{mark}")
    if plan.best is None:
        lines.append("no configuration met the Table VI SLOs")
    return "\n".join(lines)


def write_outputs(plan: Plan, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "plan.json", out / "design_space.png"
    json_path.write_text(json.dumps(plan_dict(plan), indent=2) + "\n")
    if not plots_available():
        print(f"no design_space.png: {MISSING}", file=sys.stderr)
        return [json_path]
    heat_map(plan, png_path)
    return [json_path, png_path]


def heat_map(plan: Plan, path: Path) -> None:
    """Throughput (req/s) per (prompt, token) count; blank where not evaluated (Fig. 12)."""
    import numpy as np

    prompts = sorted({c.num_prompt for c in plan.configs})
    tokens = sorted({c.num_token for c in plan.configs})
    grid = np.full((len(tokens), len(prompts)), np.nan)
    for c in plan.configs:
        grid[tokens.index(c.num_token), prompts.index(c.num_prompt)] = c.throughput_rps
    fig = new_figure(figsize=(1.5 + 0.5 * len(prompts), 1.5 + 0.4 * len(tokens)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(prompts)), [str(p) for p in prompts])
    ax.set_yticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_xlabel("prompt machines" if tokens != [0] else "machines")
    ax.set_ylabel("token machines")
    ax.set_title(f"{plan.design} {plan.goal.kind} ({plan.trace.trace})")
    fig.colorbar(image, ax=ax, label="throughput within SLOs (req/s)")
    fig.savefig(path, dpi=100)
