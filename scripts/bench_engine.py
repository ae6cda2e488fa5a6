"""Benchmark the splitserve engine against Hugging Face `transformers` on the demo model (CPU).

Both sides run the same model with the same weights (the demo Llama: hidden 256, 4 layers, byte
vocabulary 259, seeded dummy weights copied into `transformers.LlamaForCausalLM`), float32, with
the same number of torch threads, in one process. Measured, with ours and Hugging Face
interleaved (ours, HF, ours, HF, ...) and reported as medians with min and max:

1. offline throughput (useful output tokens/s) at several in-flight counts C on N requests whose
   prompt and output lengths are sampled (seeded) from the ShareGPT distribution, scaled down by
   --length-scale; ours: `LLM(max_num_seqs=C).generate(all N)`; Hugging Face: static batches of C
   requests in arrival order, left-padded, each run until its longest forced output;
2. single-request decode latency (ms per output token after the first);
3. our engine alone (Splitwise Fig. 5/6 on this hardware): decode-step time against the number of
   running sequences, and prefill time against prompt length, by timing `LLMEngine.step()`
   (`--engine-only`: this section alone, to see how a change moves the engine's steps).

Run from the repository root (the trace ships in splitserve/data/traces; --trace picks another):

    python scripts/bench_engine.py                    # full run: ~4 min on 2 cores (6 when shared)
    python scripts/bench_engine.py --quick            # smoke run: 10-40 s
    python scripts/bench_engine.py --threads 2 --json bench.json

Every explicit flag wins over the --quick preset. Trace: ShareGPT length distribution (Llama-2
tokenizer) from the Sarathi-Serve evaluation (sarathi-serve / etalon repositories, Apache-2.0).
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from engine_step_curves import (  # this script's folder
    ENGINE_ARGS,
    fmt,
    measure_decode_steps,
    measure_prefill,
    print_step_curves,
    random_prompt,
    summarize,
)

from splitserve.data import TRACES_DIR
from splitserve.engine.demo import DEMO_MODEL_CONFIG
from splitserve.engine.llm import LLM
from splitserve.engine.model.llama import checkpoint_tensors
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer

DEFAULT_TRACE = TRACES_DIR / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

FULL = {"num_requests": 64, "length_scale": 0.125, "in_flight": "1,4,16,32", "repeats": 3,
        "latency_prompt_len": 64, "latency_output_len": 64, "decode_batches": "1,2,4,8,16,32,64",
        "decode_context": 128, "decode_steps": 10, "prefill_lens": "32,64,128,256,512,1024,2048",
        "char_repeats": 5}
QUICK = {"num_requests": 8, "length_scale": 0.03125, "in_flight": "1,4", "repeats": 2,
         "latency_prompt_len": 32, "latency_output_len": 32, "decode_batches": "1,4,16",
         "decode_context": 64, "decode_steps": 5, "prefill_lens": "32,128,512", "char_repeats": 3}


# ---- settings, hardware, workload ------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small preset for a smoke run (about a minute)")
    p.add_argument("--num-requests", type=int, help=f"requests in the throughput workload ({FULL['num_requests']})")
    p.add_argument("--length-scale", type=float, help="factor on ShareGPT prompt and output lengths (0.125)")
    p.add_argument("--max-total-len", type=int, default=2048, help="clip so prompt + output <= this (2048)")
    p.add_argument("--in-flight", help="comma-separated in-flight counts C (1,4,16,32)")
    p.add_argument("--repeats", type=int, help="interleaved ours/HF repeats per measurement (3)")
    p.add_argument("--latency-prompt-len", type=int, help="single-request prompt tokens (64)")
    p.add_argument("--latency-output-len", type=int, help="single-request output tokens (64)")
    p.add_argument("--decode-batches", help="running sequences for the decode-step curve (1,2,...,64)")
    p.add_argument("--decode-context", type=int, help="prompt tokens of each sequence in the decode-step curve (128)")
    p.add_argument("--decode-steps", type=int, help="decode steps timed per batch size and repeat (10)")
    p.add_argument("--prefill-lens", help="prompt lengths for the prefill curve (32,...,2048; capped at max_model_len-1)")
    p.add_argument("--char-repeats", type=int, help="repeats of the engine characterization (5)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads, both sides (all cores)")
    p.add_argument("--policy", default="mixed", choices=["mixed", "prefill_first"], help="our scheduling policy (mixed)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn our prefix caching off (it is on by default)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="ShareGPT length csv")
    p.add_argument("--engine-only", action="store_true", help="only section 3, our engine's step curves (no "
                   "transformers side): how a change to the engine moves its decode and prefill steps")
    p.add_argument("--json", type=Path, help="write all numbers to this JSON file")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("in_flight", "decode_batches", "prefill_lens"):
        setattr(args, name, [int(x) for x in str(getattr(args, name)).split(",") if x.strip()])
    if args.num_requests < 1 or args.repeats < 1 or args.threads < 1 or min(args.in_flight) < 1:
        p.error("--num-requests, --repeats, --threads and --in-flight values must be >= 1")
    return args


def hardware() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads()}


def load_workload(args) -> list[tuple[list[int], int]]:
    """N (prompt token ids, forced output length), sampled from the trace in a seeded order."""
    if not args.trace.is_file():
        sys.exit(f"trace not found: {args.trace} (pass --trace PATH to the ShareGPT length csv)")
    with open(args.trace, newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(args.seed)
    requests = []
    for prompt_len, output_len in rng.sample(rows, args.num_requests):
        out = max(1, min(round(output_len * args.length_scale), args.max_total_len // 2))
        prompt = max(1, min(round(prompt_len * args.length_scale), args.max_total_len - out))
        requests.append((random_prompt(rng, prompt), out))
    return requests


# ---- the two sides ---------------------------------------------------------------------------
def build_ours(args, **overrides) -> LLM:
    return LLM("demo", **ENGINE_ARGS, enable_prefix_caching=not args.no_prefix_caching, policy=args.policy, **overrides)


def build_hf(reference: LLM) -> LlamaForCausalLM:
    """transformers' Llama with exactly our weights; raises if any tensor fails to load."""
    config = LlamaConfig(**DEMO_MODEL_CONFIG)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    ours = {name: tensor.contiguous() for name, tensor in checkpoint_tensors(reference.engine.runner.model)}
    result = model.load_state_dict(ours, strict=True)
    theirs = model.state_dict()
    if result.missing_keys or result.unexpected_keys or any(not torch.equal(t, theirs[k]) for k, t in ours.items()):
        raise RuntimeError(f"weights did not load into transformers' model: {result}")
    return model


def hf_generate(model, input_ids, attention_mask, new_tokens: int, streamer=None) -> torch.Tensor:
    """Greedy, forced to exactly `new_tokens` (min = max) as a static-batch server runs a batch."""
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=ByteTokenizer.PAD, eos_token_id=ByteTokenizer.EOS,
                              bos_token_id=ByteTokenizer.BOS)
    with torch.inference_mode():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                              streamer=streamer)


def hf_batches(requests, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor, int, list[int]]]:
    """Static batches in arrival order, left-padded: (input_ids, attention_mask, new tokens, prompt lens)."""
    batches = []
    for lo in range(0, len(requests), batch_size):
        chunk = requests[lo:lo + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[ByteTokenizer.PAD] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        batches.append((ids, mask, max(o for _, o in chunk), [len(p) for p, _ in chunk]))
    return batches


def run_ours(args, requests, in_flight: int) -> tuple[float, list[list[int]]]:
    llm = build_ours(args, max_num_seqs=in_flight)  # fresh engine: no prefix-cache hits from earlier runs
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=o) for _, o in requests]
    gc.collect()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    tokens = [out.token_ids for out in outputs]
    if [len(t) for t in tokens] != [o for _, o in requests]:
        raise RuntimeError("our engine did not produce the forced output lengths")
    return elapsed, tokens


def run_hf(model, requests, batches) -> tuple[float, list[list[int]]]:
    gc.collect()
    elapsed, tokens = 0.0, []
    for ids, mask, new_tokens, _ in batches:
        start = time.perf_counter()
        out = hf_generate(model, ids, mask, new_tokens)
        elapsed += time.perf_counter() - start
        tokens += out[:, ids.shape[1]:].tolist()
    return elapsed, [t[:o] for t, (_, o) in zip(tokens, requests)]


# ---- measurements ----------------------------------------------------------------------------
def measure_throughput(args, hf_model, requests) -> dict:
    useful = sum(o for _, o in requests)
    results = {}
    for in_flight in args.in_flight:
        c = min(in_flight, len(requests))
        batches = hf_batches(requests, c)
        ours, hf = [], []
        for _ in range(args.repeats):
            t_ours, ours_tokens = run_ours(args, requests, c)
            t_hf, hf_tokens = run_hf(hf_model, requests, batches)
            ours.append(useful / t_ours)
            hf.append(useful / t_hf)
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
        results[str(in_flight)] = {
            "ours": summarize(ours), "hf": summarize(hf),
            "ratio": statistics.median(ours) / statistics.median(hf),
            "hf_decode_steps": sum(b[2] for b in batches),
            "hf_padded_prompt_tokens": sum(b[0].numel() for b in batches),
            "greedy_outputs_identical": f"{same}/{len(requests)}",
        }
        print(f"  in-flight {in_flight}: ours {statistics.median(ours):.0f} tok/s, HF {statistics.median(hf):.0f} tok/s",
              file=sys.stderr)
    return results


class _TokenClock(BaseStreamer):
    """Timestamps each generated token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._saw_prompt = False

    def put(self, value) -> None:
        if self._saw_prompt:
            self.times.append(time.monotonic())
        self._saw_prompt = True

    def end(self) -> None:
        """Nothing to flush: every token's time was recorded in put()."""


def mean_gap_ms(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def measure_latency(args, hf_model) -> dict:
    if args.latency_output_len < 2:
        raise SystemExit("--latency-output-len must be >= 2 (a gap needs two tokens)")
    prompt = random_prompt(random.Random(args.seed + 1), args.latency_prompt_len)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.latency_output_len)
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    ours, hf = [], []
    for _ in range(args.repeats):
        llm = build_ours(args)
        gc.collect()
        out = llm.generate([prompt], params)[0]
        ours.append(mean_gap_ms(out.token_timestamps))
        clock = _TokenClock()
        gc.collect()
        hf_out = hf_generate(hf_model, ids, mask, args.latency_output_len, streamer=clock)
        hf.append(mean_gap_ms(clock.times))
    same = sum(a == b for a, b in zip(out.token_ids, hf_out[0, len(prompt):].tolist()))
    return {"ours_ms_per_token": summarize(ours), "hf_ms_per_token": summarize(hf),
            "ratio": statistics.median(ours) / statistics.median(hf),
            "greedy_tokens_identical": f"{same}/{args.latency_output_len}"}


def warm_up(args, hf_model) -> None:
    """One small run on each side, so first-call costs (kernel selection, allocations) are not timed."""
    rng = random.Random(args.seed + 4)
    requests = [(random_prompt(rng, n), 8) for n in (16, 48, 96, 160)]
    run_ours(args, requests, len(requests))
    run_hf(hf_model, requests, hf_batches(requests, len(requests)))


# ---- report ----------------------------------------------------------------------------------
def print_report(result: dict) -> None:
    hw, s = result["hardware"], result["settings"]
    print(f"\nHardware: {hw['cpu']}, {hw['usable_cores']} usable cores ({hw['logical_cores']} logical), "
          f"torch {hw['torch']}, transformers {hw['transformers']}, {hw['threads']} torch threads, float32")
    if "throughput" in result:
        print_against_hf(result)
    print_step_curves(result)
    if "throughput" in result:
        print(f"\nthroughput_ratio_vs_hf (C={max(s['in_flight'])}): {result['throughput_ratio_vs_hf']:.2f}x, "
              f"single_request_latency_ratio_vs_hf: {result['single_request_latency_ratio_vs_hf']:.2f}x")
    print(f"elapsed {result['elapsed_s']:.0f} s")


def print_against_hf(result: dict) -> None:
    s, w = result["settings"], result["workload"]
    print(f"Workload: {w['num_requests']} ShareGPT requests x length scale {s['length_scale']} (seed {s['seed']}): "
          f"prompt tokens mean {w['prompt_mean']:.0f} (max {w['prompt_max']}), output tokens mean "
          f"{w['output_mean']:.0f} (max {w['output_max']}), {w['useful_output_tokens']} useful output tokens; "
          f"ours policy={s['policy']}, prefix caching {'off' if s['no_prefix_caching'] else 'on'}; "
          f"{s['repeats']} interleaved repeats, median [min–max]\n")
    print("| in-flight | ours tok/s | HF static batch tok/s | ours/HF | HF decode steps | greedy outputs identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c, r in result["throughput"].items():
        print(f"| {c} | {fmt(r['ours'], 0)} | {fmt(r['hf'], 0)} | {r['ratio']:.2f}x | {r['hf_decode_steps']} | "
              f"{r['greedy_outputs_identical']} |")
    lat = result["single_request_latency"]
    print(f"\nSingle request, {s['latency_prompt_len']}-token prompt, {s['latency_output_len']} output tokens "
          "(ms per token after the first; lower is better)\n")
    print("| | ours | HF | ours/HF | greedy tokens identical |\n|---|---:|---:|---:|---:|")
    print(f"| decode ms/token | {fmt(lat['ours_ms_per_token'], 2)} | {fmt(lat['hf_ms_per_token'], 2)} | "
          f"{lat['ratio']:.2f}x | {lat['greedy_tokens_identical']} |")


def measure_against_hf(args) -> dict:
    """Sections 1 and 2: throughput and single-request latency, ours against transformers'."""
    requests = load_workload(args)
    hf_model = build_hf(build_ours(args))
    warm_up(args, hf_model)
    print("throughput ...", file=sys.stderr)
    throughput = measure_throughput(args, hf_model, requests)
    print("single-request latency ...", file=sys.stderr)
    latency = measure_latency(args, hf_model)
    prompts, outputs = [len(p) for p, _ in requests], [o for _, o in requests]
    return {
        "throughput_ratio_vs_hf": throughput[str(max(args.in_flight))]["ratio"],
        "single_request_latency_ratio_vs_hf": latency["ratio"],
        "workload": {"num_requests": len(requests), "prompt_mean": statistics.mean(prompts), "prompt_max": max(prompts),
                     "output_mean": statistics.mean(outputs), "output_max": max(outputs),
                     "useful_output_tokens": sum(outputs)},
        "throughput": throughput,
        "single_request_latency": latency,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"hardware": hardware(), "settings": settings}
    if not args.engine_only:
        result.update(measure_against_hf(args))
    print("engine characterization ...", file=sys.stderr)
    result["decode_step_ms_by_batch"] = measure_decode_steps(args)
    result["prefill_ms_by_prompt_len"] = measure_prefill(args)
    result["elapsed_s"] = time.perf_counter() - started
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
