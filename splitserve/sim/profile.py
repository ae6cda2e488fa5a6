"""`splitserve profile`: measure this project's engine into the Splitwise profile CSV format, so
the simulator (`load_perf_models(path)`) can be driven by, and checked against, the real engine.

Like the Splitwise profiles: a prompt-size sweep at batch 1 and a batch-size sweep at a reference
prompt size, one output size, each point `repeats` times (interleaved, so drift spreads over all
points). One point: `batch_size` random prompts of `prompt_size` tokens prefilled in a single
iteration (prompt_time), then decoded together (token_time: the median decode iteration).

Beyond the Splitwise format, a chunk sweep: a prompt of `chunk_size` new tokens after a cached
prefix of each of `chunk_contexts` tokens (a prefix-cache hit, which runs the same attention over
earlier KV as a chunked prefill's later chunks), written with the `prefix_size` column.
"""
from __future__ import annotations

import csv
import random
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_builder import load_metadata
from splitserve.engine.outputs import StepStats
from splitserve.engine.sampling_params import SamplingParams
from splitserve.sim.from_config import shape_of
from splitserve.sim.perf_model import CSV_COLUMNS, PREFIX_COLUMN, ModelShape

REFERENCE_PROMPT = 512  # Splitwise's reference prompt size
SEED = 0
BLOCK_SIZE = 16


@dataclass(frozen=True)
class ProfileSpec:
    model: str = "demo"
    hardware: str = "cpu"
    device: str = "cpu"
    threads: int = 1
    repeats: int = 3
    prompt_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    token_size: int = 32
    chunk_size: int = 256
    chunk_contexts: tuple[int, ...] = (256, 512, 1024)  # multiples of BLOCK_SIZE (cached whole); () for none

    def __post_init__(self) -> None:
        for name in ("threads", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.token_size < 2:
            raise ValueError(f"token_size must be >= 2 (one decode iteration at least), got {self.token_size!r}")
        for name in ("prompt_sizes", "batch_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {sizes!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size!r}")
        if any(c < BLOCK_SIZE or c % BLOCK_SIZE for c in self.chunk_contexts):
            raise ValueError(f"chunk_contexts must be positive multiples of {BLOCK_SIZE}, got {self.chunk_contexts!r}")

    @property
    def reference_prompt(self) -> int:
        """512 if profiled, else the largest prompt size below it, else the smallest."""
        below = [p for p in self.prompt_sizes if p <= REFERENCE_PROMPT]
        return max(below) if below else min(self.prompt_sizes)

    def points(self) -> list[tuple[int, int]]:
        """(prompt_size, batch_size) of one repetition: the prompt sweep, then the batch sweep (the
        reference point is in both, as in the Splitwise data)."""
        return ([(p, 1) for p in sorted(set(self.prompt_sizes))]
                + [(self.reference_prompt, b) for b in sorted(set(self.batch_sizes))])

    def sweep(self) -> list[tuple[int, int, int]]:
        """(prompt_size, batch_size, prefix_size) of one repetition: `points()`, then the chunk sweep."""
        return [(p, b, 0) for p, b in self.points()] + [(self.chunk_size, 1, c) for c in self.chunk_contexts]

    def longest(self) -> int:
        """Tokens of the longest sequence any point runs."""
        return max(c + p for p, _, c in self.sweep()) + self.token_size


def build_engine(spec: ProfileSpec) -> LLMEngine:
    """Room for the largest batch, prefilled in one iteration. The prefix cache is on for the chunk
    sweep; random prompts never hit it otherwise."""
    longest = spec.longest()
    limit = load_metadata(spec.model, EngineConfig())[2]
    if longest > limit:
        raise ValueError(f"prompt_sizes or chunk_contexts + chunk_size, + token_size {spec.token_size}: {longest} "
                         f"tokens exceeds the model's max_model_len={limit}")
    sweep = spec.sweep()
    blocks = max(b * -(-(c + p + spec.token_size) // BLOCK_SIZE) for p, b, c in sweep)
    return LLMEngine(spec.model, policy="prefill_first", device=spec.device, block_size=BLOCK_SIZE,
                     max_model_len=longest, num_kv_blocks=blocks + blocks // 20 + 4, max_num_seqs=max(spec.batch_sizes),
                     prompt_token_budget=max(p * b for p, b, _ in sweep))


def measure_point(engine: LLMEngine, prompt_size: int, batch_size: int, token_size: int,
                  rng: random.Random, prefix_size: int = 0) -> tuple[float, float]:
    """(prompt ms, median token ms) of one batch run to completion; with `prefix_size`, each
    prompt starts with that many tokens cached just before (by a request of the prefix alone)."""
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prefix_size + prompt_size)] for _ in range(batch_size)]
    if prefix_size:
        run(engine, [p[:prefix_size] for p in prompts], 1)
    steps = run(engine, prompts, token_size)
    prefill = [s for s in steps if s.phase == "prefill"]
    decode = [s.seconds for s in steps if s.phase == "decode"]
    if len(prefill) != 1 or len(decode) != token_size - 1 or prefill[0].prefill_tokens != prompt_size * batch_size:
        raise RuntimeError(f"expected 1 prefill of {batch_size} x {prompt_size} tokens (after {prefix_size} cached) "
                           f"and {token_size - 1} decode iterations, got {[s.prefill_tokens for s in prefill]} "
                           f"and {len(decode)}")
    return prefill[0].seconds * 1000, statistics.median(decode) * 1000


def run(engine: LLMEngine, prompts: list[list[int]], token_size: int) -> list[StepStats]:
    """Run `prompts` together to `token_size` tokens each; every iteration's stats."""
    params = SamplingParams(max_tokens=token_size, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    return steps


@dataclass(frozen=True)
class ProfileResult:
    rows: tuple[dict, ...]  # in the CSV format, times in ms
    shape: ModelShape       # of the profiled model, for the simulator's KV transfer model


def run_profile(spec: ProfileSpec, on_point: Callable[[dict], None] | None = None) -> ProfileResult:
    """Measure every point `spec.repeats` times."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        engine, rng = build_engine(spec), random.Random(SEED)
        measure_point(engine, min(spec.prompt_sizes), 1, 2, rng)  # warm-up, not recorded
        rows = []
        for _ in range(spec.repeats):
            for prompt_size, batch_size, prefix_size in spec.sweep():
                prompt_ms, token_ms = measure_point(engine, prompt_size, batch_size, spec.token_size, rng, prefix_size)
                rows.append(_row(spec, prompt_size, batch_size, prompt_ms, token_ms, prefix_size))
                if on_point is not None:
                    on_point(rows[-1])
        return ProfileResult(tuple(rows), model_shape(engine))
    finally:
        torch.set_num_threads(previous_threads)


def _row(spec: ProfileSpec, prompt_size: int, batch_size: int, prompt_ms: float, token_ms: float,
         prefix_size: int) -> dict:
    return {"model": Path(spec.model).name, "hardware": spec.hardware, "prompt_size": prompt_size,
            "batch_size": batch_size, "token_size": spec.token_size, "peak_power": 0, "average_power": 0,
            "prompt_time": prompt_ms, "token_time": token_ms,
            "e2e_time": prompt_ms + token_ms * (spec.token_size - 1), "tensor_parallel": 1,
            PREFIX_COLUMN: prefix_size}


def write_csv(rows: tuple[dict, ...], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=(*CSV_COLUMNS, PREFIX_COLUMN))
        writer.writeheader()
        writer.writerows(rows)
    return path


def model_shape(engine: LLMEngine) -> ModelShape:
    """Layers and KV bytes per token of the engine's model (every layer's, its layer groups aside),
    as the simulator's transfer model needs."""
    return shape_of(engine.model_config, engine.kv_cache.data.dtype.itemsize)


def summary_table(rows: tuple[dict, ...]) -> str:
    """Markdown: per (prompt, batch, cached prefix) point, the median prompt and token ms over its runs."""
    groups: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["prompt_size"], row["batch_size"], row[PREFIX_COLUMN]].append(row)
    lines = ["| prompt | batch | cached | runs | prompt ms | prompt tok/s | token ms | decode tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (prompt, batch, cached), group in sorted(groups.items()):
        prompt_ms = statistics.median(r["prompt_time"] for r in group)
        token_ms = statistics.median(r["token_time"] for r in group)
        lines.append(f"| {prompt} | {batch} | {cached} | {len(group)} | {prompt_ms:.2f} "
                     f"| {prompt * batch / prompt_ms * 1000:.0f} | {token_ms:.2f} | {batch / token_ms * 1000:.0f} |")
    return "\n".join(lines)
