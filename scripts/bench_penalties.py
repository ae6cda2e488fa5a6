"""The sampler's penalties (repetition, frequency, presence) over decode steps: one `Penalties`
kept across the steps, which counts only each sequence's new token into the counts it keeps on
the device, against a fresh one per step, which counts every sequence's whole context again (what
each step paid before the kept counts). Each step appends one token to every sequence, then
applies the penalties.

    python scripts/bench_penalties.py                     # this machine's CPU, Llama-3's vocabulary
    python scripts/bench_penalties.py --device cuda --json penalties.json

Contexts are random ids, each sequence's length drawn uniformly from 1 to --context (so a batch
holds about batch x context / 2 tokens); each time is the median of --iters steps after one untimed
step (CUDA events on a GPU); `equal` says whether the two gave the same logits at the last step.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from bench_moe import emit, print_markdown, ratio, time_calls  # this script's folder

from splitserve.engine.penalties import Penalties
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

VOCAB = 128256  # Llama-3's


def batch_of(batch: int, context: int, vocab: int) -> list[Sequence]:
    draw = random.Random(batch * 7919 + context)
    params = SamplingParams(max_tokens=1 << 20, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    return [Sequence(f"s{i}", [draw.randrange(vocab) for _ in range(draw.randint(1, context))], params)
            for i in range(batch)]


def measure(batch: int, context: int, vocab: int, iters: int, device: torch.device) -> dict:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).to(device)
    row, last = {"batch": batch, "context": context}, {}
    for name, fresh in (("kept", False), ("fresh", True)):
        seqs, kept = batch_of(batch, context, vocab), Penalties()

        def step() -> torch.Tensor:
            for seq in seqs:
                seq.append_token(seq.num_tokens % vocab)
            last[name] = (Penalties() if fresh else kept).apply(logits, seqs)
            return last[name]

        row[f"{name}_ms"] = time_calls(step, iters, device.type == "cuda") * 1e3
    row["speedup"] = row["fresh_ms"] / row["kept_ms"]
    row["equal"] = torch.equal(last["kept"], last["fresh"])  # the same steps on the same sequences
    return row


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; vocabulary {result['vocab']}; a step's penalties, median of "
          f"{result['iters']} steps")
    print_markdown(["batch", "context", "kept ms:", "fresh ms:", "speedup:", "equal"],
                   [[r["batch"], r["context"], f"{r['kept_ms']:.2f}", f"{r['fresh_ms']:.2f}", ratio(r["speedup"]),
                     r["equal"]] for r in result["rows"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256", help="comma-separated")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated: the longest context of a batch")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--iters", type=int, default=20, help="timed steps per row")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device takes cpu or cuda, got {args.device}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [measure(int(b), int(c), args.vocab, args.iters, device)
            for c in args.contexts.split(",") for b in args.batches.split(",")]
    return emit(args, {"device": name, "vocab": args.vocab, "iters": args.iters, "rows": rows}, print_table)


if __name__ == "__main__":
    sys.exit(main())
