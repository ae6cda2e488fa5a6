"""Speculative decoding by n-gram lookup (engine.num_speculative_tokens) against decoding a token a
step, side by side on one engine build: a batch of requests decoded to the end, each way in turn.

    python scripts/bench_speculation.py                             # the demo model on this CPU
    python scripts/bench_speculation.py --model /path/to/ckpt --device cuda --json spec.json

Two workloads bracket what drafting does: greedy (the demo model's random weights fall into loops,
so most drafts are kept, as a real model's are where its output copies its context) and sampling at
temperature 1 (its output is noise: drafts are mostly rejected, so the rows show what checking them
costs). Each request is seeded, so every way gives the very same tokens (`equal`). Per row: drafts
kept / drafted, the engine steps, output tokens/s over the whole batch (prefill included: the same
work each way), and each request's time per output token (its first token to its last over the
tokens between), median over requests and runs; `speedup` is tokens/s against k = 0's.

`--edit-every N` adds a Predicted Outputs row to each (the `prediction` column): each request sends
as its prediction its own output (the base's, seeded) with every Nth token changed, as an edited
file's answer repeats the file but where it was edited; `from prediction` is the share of the
prediction's drafts kept.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_moe import emit, pct, print_markdown, ratio  # this script's folder

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: list[list[int]], temperature: float, max_tokens: int,
        predictions: list[list[int]] | None = None) -> dict:
    """One batch to the end (each request with its prediction, where given): its outputs' ids, and
    what it took."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                                                           ignore_eos=True, detokenize=False,
                                                           prediction=predictions[i] if predictions else ()))
    done, steps, drafted, kept = {}, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        drafted, kept = drafted + engine.last_step.draft_tokens, kept + engine.last_step.accepted_tokens
    seconds = time.perf_counter() - start
    finals = [done[f"r{i}"] for i in range(len(prompts))]
    outputs = [final.outputs[0] for final in finals]
    tpot = [(o.token_timestamps[-1] - o.token_timestamps[0]) / (len(o.token_ids) - 1) for o in outputs]
    return {"ids": [o.token_ids for o in outputs], "steps": steps, "drafted": drafted, "kept": kept,
            "predicted": [sum(f.accepted_prediction_tokens for f in finals),
                          sum(f.rejected_prediction_tokens for f in finals)],
            "tokens_per_s": sum(len(o.token_ids) for o in outputs) / seconds, "tpot": tpot}


def measure(engines: dict[int, LLMEngine], batch: int, temperature: float, args) -> list[dict]:
    draw = random.Random(batch)
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompts = [[draw.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
    rows, outputs = compare(engines, prompts, temperature, args)
    if args.edit_every:  # each request's own output (the same whichever way), every Nth token changed
        predictions = [[(t + 1) % vocab if (j + 1) % args.edit_every == 0 else t for j, t in enumerate(ids)]
                       for ids in outputs]
        rows += compare(engines, prompts, temperature, args, predictions, f"edited 1/{args.edit_every}")[0]
    return rows


def compare(engines: dict[int, LLMEngine], prompts: list[list[int]], temperature: float, args,
            predictions: list[list[int]] | None = None, prediction: str = "none") -> tuple[list[dict], list]:
    """The batch run by every engine in turn, `args.repeats` times: a row per engine, and the base's
    outputs (token ids per request)."""
    runs: dict[int, list[dict]] = {k: [] for k in engines}
    for repeat in range(args.repeats):
        for k in (list(engines) if repeat % 2 == 0 else list(reversed(engines))):  # alternate who goes first
            runs[k].append(run(engines[k], prompts, temperature, args.max_tokens, predictions))
    rows, base = [], runs[min(engines)]
    for k, results in runs.items():
        drafted, kept = sum(r["drafted"] for r in results), sum(r["kept"] for r in results)
        accepted, rejected = (sum(r["predicted"][i] for r in results) for i in (0, 1))
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in results)
        rows.append({"temperature": temperature, "batch": len(prompts), "prediction": prediction, "k": k,
                     "from_prediction": accepted / (accepted + rejected) if accepted + rejected else None,
                     "drafted": drafted,
                     "acceptance": kept / drafted if drafted else None,
                     "steps": statistics.median(r["steps"] for r in results), "tokens_per_s": tokens_per_s,
                     "tpot_ms_p50": statistics.median(t for r in results for t in r["tpot"]) * 1e3,
                     "speedup": tokens_per_s / statistics.median(r["tokens_per_s"] for r in base),
                     "equal": all(r["ids"] == b["ids"] for r, b in zip(results, base))})
    return rows, base[0]["ids"]


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; model {result['model']}; {result['prompt_tokens']}-token prompts, "
          f"{result['max_tokens']} tokens each; prompt_lookup_min {result['prompt_lookup_min']}; median of "
          f"{result['repeats']} runs")
    print_markdown(["temperature", "batch", "prediction", "k:", "kept:", "from prediction:", "steps:", "tok/s:",
                    "TPOT p50 ms:", "speedup:", "equal"],
                   [[r["temperature"], r["batch"], r["prediction"], r["k"], pct(r["acceptance"]),
                     pct(r["from_prediction"]), f"{r['steps']:.0f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['tpot_ms_p50']:.2f}", ratio(r["speedup"]), r["equal"]]
                    for r in result["rows"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo, or a checkpoint directory")
    p.add_argument("--load-format", default="auto", help="auto, or dummy (random weights for its config.json)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", default="0,2,4", help="num_speculative_tokens values, comma-separated (the first the base)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated")
    p.add_argument("--temperatures", default="0,1", help="comma-separated")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="the fewest last tokens looked up (1: draft "
                   "whenever the last token occurred before, so noise drafts too: what rejected drafts cost)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--edit-every", type=int, default=0, help="also run with predictions: each request's output "
                   "with every Nth token changed (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a worker with one CPU gets 1)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    ks = [int(k) for k in args.k.split(",")]
    if len(ks) < 2 or ks[0] != min(ks):
        p.error("--k takes the base (the smallest, usually 0) first, then at least one more")
    if args.edit_every < 0 or args.edit_every == 1:
        p.error("--edit-every takes 0 (no predictions) or N >= 2 (every Nth token of a prediction changed)")
    torch.set_num_threads(args.threads)
    engines = {k: LLMEngine(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                            max_model_len=args.prompt_tokens + args.max_tokens + 1, num_speculative_tokens=k,
                            prompt_lookup_min=args.prompt_lookup_min)
               for k in ks}
    rows = [row for t in args.temperatures.split(",") for b in args.batches.split(",")
            for row in measure(engines, int(b), float(t), args)]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return emit(args, {"device": device, "model": args.model, "prompt_lookup_min": args.prompt_lookup_min,
                       "prompt_tokens": args.prompt_tokens,
                       "max_tokens": args.max_tokens, "repeats": args.repeats, "edit_every": args.edit_every,
                       "rows": rows}, print_table)


if __name__ == "__main__":
    sys.exit(main())
