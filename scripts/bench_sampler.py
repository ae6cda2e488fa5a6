"""The sampler's draw for a batch of randomly sampled vocabulary-wide rows (temperature 0.8, with
top-k, top-p or min-p, or none), the torch path (a gather, shift, division, filters with a sort of
every row for top-p, softmax, cumulative sum and search) against the Triton kernel that draws
every row in one launch (`engine/triton_sampling.py`): what a decode step pays after its forward
for requests that sample. Each row also says for how many of its rows the two paths drew
different tokens from the same seeded uniforms (0 expected: the kernel is checked against the
torch path; a target within rounding of a boundary between two tokens may differ).

    python scripts/bench_sampler.py --json sampler.json    # CUDA: Llama-3's vocabulary, batches 1 to 256
    python scripts/bench_sampler.py --tiny                 # a small vocabulary on the CPU (Triton's interpreter)
    python scripts/bench_sampler.py --warps 16             # the kernel in 16 warps, twice the engine's 8

Rows are random logits (standard normal times 3); each time is the median of --iters draws after
one untimed draw (CUDA events on a GPU), of requests without a seed (a seed's uniform is drawn on
the host, the same for both paths). `sampler.KERNEL_ROWS`, the batch from which the engine takes
the kernel, should sit where the `speedup` column crosses 1.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from bench_moe import emit, print_markdown, ratio, run_device, time_calls  # this script's folder

from splitserve.engine import sampler, triton_sampling
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

FILTERS = {"none": (-1, 1.0, 0.0), "top-p": (-1, 0.9, 0.0), "top-k": (50, 1.0, 0.0), "top-k+top-p": (50, 0.9, 0.0),
           "min-p": (-1, 1.0, 0.05), "top-p 0.99": (-1, 0.99, 0.0)}
BATCHES, TINY_BATCHES = "1,8,16,32,64,128,256", "1,4"
VOCAB, TINY_VOCAB = 128256, 3000  # Llama-3's


@contextmanager
def kernel_path(on: bool):
    """The sampler's random rows through the kernel at any batch (on), or never."""
    rows, runs = sampler.KERNEL_ROWS, sampler.runs_kernels
    sampler.KERNEL_ROWS = 1 if on else sys.maxsize
    sampler.runs_kernels = lambda x: True
    try:
        yield
    finally:
        sampler.KERNEL_ROWS, sampler.runs_kernels = rows, runs


def measure(name: str, batch: int, vocab: int, iters: int, device: torch.device) -> dict:
    top_k, top_p, min_p = FILTERS[name]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).mul_(3).to(device)

    def requests(seeded: bool) -> list[Sequence]:
        return [Sequence(f"s{i}", [1], SamplingParams(max_tokens=8, temperature=0.8, top_k=top_k, top_p=top_p,
                                                       min_p=min_p, seed=i if seeded else None)) for i in range(batch)]

    row, tokens, timed = {"filter": name, "batch": batch, "vocab": vocab}, {}, requests(False)
    for path, on in (("torch", False), ("kernel", True)):
        with kernel_path(on):
            drawer = Sampler()
            row[f"{path}_ms"] = time_calls(lambda: drawer.draw(logits, timed).token_ids, iters,
                                           device.type == "cuda") * 1e3
            tokens[path] = [t.token_id for t in Sampler().sample(logits, requests(True))]
    row["tokens_differing"] = sum(a != b for a, b in zip(tokens["torch"], tokens["kernel"]))
    row["speedup"] = row["torch_ms"] / row["kernel_ms"]
    return row


def print_table(result: dict) -> None:
    print(f"Device: {result['device']}; vocabulary {result['vocab']}, float32 rows; "
          f"the kernel in {result['warps']} warps")
    print_markdown(["filter", "batch", "torch ms:", "kernel ms:", "speedup:", "tokens differing:"],
                   [[r["filter"], r["batch"], f"{r['torch_ms']:.3f}", f"{r['kernel_ms']:.3f}", ratio(r["speedup"]),
                     r["tokens_differing"]] for r in result["rows"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small vocabulary on the CPU, under Triton's interpreter")
    p.add_argument("--batches", help=f"comma-separated (default {BATCHES}; --tiny: {TINY_BATCHES})")
    p.add_argument("--vocab", type=int, help=f"default {VOCAB}; --tiny: {TINY_VOCAB}")
    p.add_argument("--filters", default=",".join(FILTERS), help=f"comma-separated, of {', '.join(FILTERS)}")
    p.add_argument("--iters", type=int, default=50, help="timed calls per row")
    p.add_argument("--warps", type=int, default=triton_sampling.WARPS, help="the kernel's warps a row "
                   f"(default {triton_sampling.WARPS}, the engine's)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    names = args.filters.split(",")
    if not set(names) <= set(FILTERS):
        p.error(f"--filters takes {', '.join(FILTERS)}; got {args.filters}")
    batches = [int(b) for b in (args.batches or (TINY_BATCHES if args.tiny else BATCHES)).split(",")]
    device, _ = run_device(p, args)
    triton_sampling.WARPS = args.warps
    vocab = args.vocab or (TINY_VOCAB if args.tiny else VOCAB)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [measure(f, b, vocab, args.iters, device) for f in names for b in batches]
    return emit(args, {"device": name, "vocab": vocab, "warps": args.warps, "rows": rows}, print_table)


if __name__ == "__main__":
    sys.exit(main())
