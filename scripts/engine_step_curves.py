"""Our engine's step curves (Splitwise Fig. 5/6 on this hardware): decode-step time against the
number of running sequences and prefill time against prompt length, each by timing
`LLMEngine.step()` on the demo model; section 3 of `bench_engine.py` (`--engine-only`: it alone)."""
from __future__ import annotations

import random
import statistics
import sys
import time

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams

ENGINE_ARGS = {"device": "cpu", "dtype": "float32"}
NUM_BYTE_TOKENS = 256  # prompts are random byte tokens, never special ones


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(NUM_BYTE_TOKENS) for _ in range(length)]


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _steps_until_all_decoding(engine: LLMEngine) -> None:
    policy = engine.policy
    while policy.waiting or not all(seq.is_decoding for seq in policy.running):
        engine.step()


def measure_decode_steps(args) -> dict:
    """Step time with B sequences decoding (each about --decode-context tokens of context). The
    prefill_first policy prefills every prompt before any decode, so all B start at the same length."""
    batches = args.decode_batches
    engine = LLMEngine("demo", **ENGINE_ARGS, policy="prefill_first", max_num_seqs=max(batches),
                       enable_prefix_caching=False)
    rng = random.Random(args.seed + 2)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.decode_steps + 2)
    times = {b: [] for b in batches}
    counter = 0
    for _ in range(args.char_repeats):
        for b in batches:
            ids = [f"d{counter + i}" for i in range(b)]
            counter += b
            for request_id in ids:
                engine.add_request(request_id, random_prompt(rng, args.decode_context), params)
            _steps_until_all_decoding(engine)
            for _ in range(args.decode_steps):
                start = time.perf_counter()
                engine.step()
                times[b].append((time.perf_counter() - start) * 1e3)
                if len(engine.policy.running) != b:
                    sys.exit(f"{b} sequences of {args.decode_context} tokens do not all fit the demo engine's KV "
                             "cache: lower --decode-batches or --decode-context")
            for request_id in ids:
                engine.abort(request_id)
    return {str(b): {**summarize(t), "context_tokens": f"{args.decode_context + 1}-{args.decode_context + args.decode_steps}",
                     "tokens_per_s": b / statistics.median(t) * 1e3} for b, t in times.items()}


def measure_prefill(args) -> dict:
    """Time of the one step that prefills a whole prompt (prefill_first policy: no chunking)."""
    engine = LLMEngine("demo", **ENGINE_ARGS, policy="prefill_first", enable_prefix_caching=False)
    lens = sorted({min(n, engine.max_model_len - 1) for n in args.prefill_lens})
    rng = random.Random(args.seed + 3)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    times = {n: [] for n in lens}
    for rep in range(args.char_repeats):
        for n in lens:
            engine.add_request(f"p{rep}-{n}", random_prompt(rng, n), params)
            start = time.perf_counter()
            engine.step()
            times[n].append((time.perf_counter() - start) * 1e3)
            if engine.has_unfinished_requests():
                raise RuntimeError(f"a {n}-token prompt did not prefill in one step")
    return {str(n): {**summarize(t), "tokens_per_s": n / statistics.median(t) * 1e3} for n, t in times.items()}


def fmt(stats: dict, digits: int = 1) -> str:
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}–{stats['max']:.{digits}f}]"


def print_step_curves(result: dict) -> None:
    s = result["settings"]
    print(f"\nOur engine, decode step vs running sequences ({s['char_repeats']} x {s['decode_steps']} steps)\n")
    print("| running seqs | context tokens | step ms | tokens/s |\n|---:|---:|---:|---:|")
    for b, r in result["decode_step_ms_by_batch"].items():
        print(f"| {b} | {r['context_tokens']} | {fmt(r, 2)} | {r['tokens_per_s']:.0f} |")
    print(f"\nOur engine, prefill step vs prompt length ({s['char_repeats']} repeats)\n")
    print("| prompt tokens | step ms | prompt tokens/s |\n|---:|---:|---:|")
    for n, r in result["prefill_ms_by_prompt_len"].items():
        print(f"| {n} | {fmt(r, 2)} | {r['tokens_per_s']:.0f} |")
