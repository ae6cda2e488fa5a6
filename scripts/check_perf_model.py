"""The performance model against the engine, one iteration at a time: a seeded stream of requests
(prompts of 100 to 1,200 tokens, 20 to 120 output tokens) through one in-process engine with
Sarathi-Serve's chunked batching, each iteration timed and compared with
`PerfModel.iteration_time` of the same work (prefill tokens, chunk context, decodes and their
contexts), from a `splitserve profile` of this machine. Prints measured / modelled per phase.

    python scripts/check_perf_model.py                    # profiles the engine first (about 15 s)
    python scripts/check_perf_model.py --profile cpu.csv  # a profile measured before
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.machine import cpu_name
from splitserve.sim.perf_model import load_perf_models
from splitserve.sim.profile import ProfileSpec, run_profile, write_csv

PROMPTS, OUTPUTS, STEPS_BETWEEN = (100, 300, 600, 900, 1200), (20, 60, 120), (1, 3, 6)
WARM_UP = 5  # iterations left out


def timed_iterations(chunk: int, num_requests: int, seed: int) -> list[tuple]:
    """(seconds, phase, prefill tokens, decodes, decode context, chunk context) of every iteration."""
    engine = LLMEngine("demo", policy="mixed", chunk_token_budget=chunk, num_kv_blocks=2000, block_size=16)
    rng, vocab, rows = random.Random(seed), engine.model_config.vocab_size, []

    def step() -> None:
        engine.step()
        s = engine.last_step
        rows.append((s.seconds, s.phase, s.prefill_tokens, s.decode_tokens, s.decode_context_tokens,
                     s.chunk_context_tokens))

    for i in range(num_requests):
        params = SamplingParams(max_tokens=rng.choice(OUTPUTS), ignore_eos=True, temperature=0.0)
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.choice(PROMPTS))], params)
        for _ in range(rng.choice(STEPS_BETWEEN)):
            if engine.has_unfinished_requests():
                step()
    while engine.has_unfinished_requests():
        step()
    return rows[WARM_UP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="a `splitserve profile` CSV of the demo model (default: measure)")
    parser.add_argument("--chunk", type=int, default=256, help="the chunk token budget")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        profile = args.profile or write_csv(run_profile(ProfileSpec(repeats=2)).rows, Path(folder) / "cpu.csv")
        model = load_perf_models(profile)["demo", "cpu", 1]
    print(f"{cpu_name()}, one thread, demo model, chunks of {args.chunk}\n")
    print("| phase | iterations | measured / modelled, P10 | median | P90 |")
    print("|---|---:|---:|---:|---:|")
    rows = timed_iterations(args.chunk, args.num_requests, args.seed)
    for phase in ("prefill", "decode", "mixed"):
        ratios = sorted(s / model.iteration_time(p, d, dc, cc) for s, ph, p, d, dc, cc in rows if ph == phase)
        if ratios:
            print(f"| {phase} | {len(ratios)} | {ratios[len(ratios) // 10]:.2f} | {statistics.median(ratios):.2f} "
                  f"| {ratios[9 * len(ratios) // 10]:.2f} |")


if __name__ == "__main__":
    main()
