"""Top-k, top-p and min-p over a batch of vocabulary-wide rows, the torch path (a topk, a sort of
every row for top-p) against the Triton kernel that finds each row's threshold without sorting
(`engine/triton_token_filters.py`), on the same rows: the filters alone, and the sampler's whole
draw for requests that set them (temperature 0.8, a seed each), which is what a decode step pays
after its forward. Each row says in how many rows the two paths kept different tokens (0 expected:
the kernel is checked against the torch path) and whether the draws gave the same tokens.

    python scripts/bench_sampler.py --json sampler.json    # CUDA: Llama-3's vocabulary, batches 1 to 256
    python scripts/bench_sampler.py --tiny                 # a small vocabulary on the CPU (Triton's interpreter)

Rows are random logits (standard normal times 3), shifted to a maximum of 0 as the sampler shifts
them; each time is the median of --iters calls after one untimed call (CUDA events on a GPU).
`token_filters.KERNEL_ROWS`, the batch from which the engine takes the kernel, should sit where
the `speedup` column crosses 1.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from bench_moe import emit, print_markdown, ratio, run_device, time_calls  # this script's folder

from splitserve.engine import token_filters
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

FILTERS = {"top-p": (-1, 0.9, 0.0), "top-k": (50, 1.0, 0.0), "top-k+top-p": (50, 0.9, 0.0), "min-p": (-1, 1.0, 0.05),
           "top-p 0.99": (-1, 0.99, 0.0)}
BATCHES, TINY_BATCHES = "1,8,16,32,64,128,256", "1,4"
VOCAB, TINY_VOCAB = 128256, 3000  # Llama-3's


@contextmanager
def kernel_path(on: bool):
    """`filter_tokens` through the kernel at any batch (on), or never."""
    rows, runs = token_filters.KERNEL_ROWS, token_filters.runs_kernels
    token_filters.KERNEL_ROWS = 1 if on else sys.maxsize
    token_filters.runs_kernels = lambda x: True
    try:
        yield
    finally:
        token_filters.KERNEL_ROWS, token_filters.runs_kernels = rows, runs


def measure(name: str, batch: int, vocab: int, iters: int, device: torch.device) -> dict:
    top_k, top_p, min_p = FILTERS[name]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).mul_(3).to(device)
    scaled = logits - logits.amax(dim=-1, keepdim=True)
    settings = ([top_k] * batch, [top_p] * batch, [min_p] * batch)
    seqs = [Sequence(f"s{i}", [1], SamplingParams(max_tokens=8, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p,
                                                   seed=i)) for i in range(batch)]
    row = {"filter": name, "batch": batch, "vocab": vocab}
    kept, tokens = {}, {}
    for path, on in (("torch", False), ("kernel", True)):
        with kernel_path(on):
            kept[path] = token_filters.filter_tokens(scaled.clone(), *settings).isfinite()
            work = scaled.clone()  # the kernel filters in place; filtered again, a row stays as it is
            row[f"{path}_ms"] = time_calls(lambda: token_filters.filter_tokens(work, *settings), iters,
                                           device.type == "cuda") * 1e3
            row[f"sampler_{path}_ms"] = time_calls(lambda: Sampler().draw(logits, seqs).token_ids, iters,
                                                   device.type == "cuda") * 1e3
            tokens[path] = [t.token_id for t in Sampler().sample(logits, seqs)]
    row["rows_differing"] = int((kept["torch"] != kept["kernel"]).any(dim=-1).sum())
    row["same_tokens"] = tokens["torch"] == tokens["kernel"]
    row["speedup"] = row["torch_ms"] / row["kernel_ms"]
    row["sampler_speedup"] = row["sampler_torch_ms"] / row["sampler_kernel_ms"]
    return row


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; vocabulary {result['vocab']}, float32 rows")
    print_markdown(["filter", "batch", "torch ms:", "kernel ms:", "speedup:", "sampler torch ms:",
                    "sampler kernel ms:", "sampler speedup:", "rows differing:", "same tokens"],
                   [[r["filter"], r["batch"], f"{r['torch_ms']:.3f}", f"{r['kernel_ms']:.3f}", ratio(r["speedup"]),
                     f"{r['sampler_torch_ms']:.3f}", f"{r['sampler_kernel_ms']:.3f}", ratio(r["sampler_speedup"]),
                     r["rows_differing"], r["same_tokens"]] for r in result["rows"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small vocabulary on the CPU, under Triton's interpreter")
    p.add_argument("--batches", help=f"comma-separated (default {BATCHES}; --tiny: {TINY_BATCHES})")
    p.add_argument("--vocab", type=int, help=f"default {VOCAB}; --tiny: {TINY_VOCAB}")
    p.add_argument("--filters", default=",".join(FILTERS), help=f"comma-separated, of {', '.join(FILTERS)}")
    p.add_argument("--iters", type=int, default=50, help="timed calls per row")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    names = args.filters.split(",")
    if not set(names) <= set(FILTERS):
        p.error(f"--filters takes {', '.join(FILTERS)}; got {args.filters}")
    batches = [int(b) for b in (args.batches or (TINY_BATCHES if args.tiny else BATCHES)).split(",")]
    device, _ = run_device(p, args)
    vocab = args.vocab or (TINY_VOCAB if args.tiny else VOCAB)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [measure(f, b, vocab, args.iters, device) for f in names for b in batches]
    return emit(args, {"device": name, "vocab": vocab, "rows": rows}, print_table)


if __name__ == "__main__":
    sys.exit(main())
