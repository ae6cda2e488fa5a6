"""What LoRA adapters cost a decode step: the same batch of running sequences stepped on the base
model, all under one adapter, and spread over several adapters (round robin, so each adapter's
rows are not one run), every adapter of one rank on all seven dense projections. Each adapter in
an eager step adds two small matmuls per projection; a step a decode graph replays adds two
kernels per projection, whatever the adapters (engine/model/lora.py).

    python scripts/bench_lora.py                                  # this CPU, a small Llama shape
    python scripts/bench_lora.py --shape llama3-8b --device cuda --json lora.json
    python scripts/bench_lora.py --shape llama3-8b --device cuda --cuda-graph-max-batch 0   # eager steps

Dummy weights and adapters (no download), one engine with every adapter loaded: each row's batch
enters decoding (its KV imported), is stepped, and leaves. Greedy, prefix caching off, steps timed
by the wall clock around `LLMEngine.step` (median of --steps, after --warm-up untimed), with the
engine's own scheduling (async on CUDA, where decode steps replay graphs up to
--cuda-graph-max-batch sequences). The sweep runs --repeats times, its rows interleaved; a row reports the median
run and the range.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.dummy_adapter import projection_shapes, write_adapter
from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.shapes import LLAMA3_8B, SHAPES

REQUEST_IDS = itertools.count()
SMALL = {**LLAMA3_8B, "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 4, "torch_dtype": "float32"}


def build_engine(model_dir: str, adapters: dict[str, str], max_batch: int, args) -> LLMEngine:
    """One engine for every row (every adapter loaded), its KV cache sized for the largest batch."""
    max_len = args.context + args.warm_up + args.steps + 8
    return LLMEngine(model_dir, policy="token", load_format="dummy", enable_prefix_caching=False,
                     device=args.device, max_num_seqs=max_batch, max_model_len=max_len,
                     num_kv_blocks=max_batch * -(-max_len // 16), lora_modules=adapters,
                     cuda_graph_max_batch=args.cuda_graph_max_batch)


def measure(engine: LLMEngine, batch: int, spread: int, args) -> dict:
    """`spread`: 0 the base model, else how many adapters the batch's sequences take in turn. The
    batch enters decoding (its KV imported), steps, and leaves the engine empty again."""
    names, rng, vocab = list(engine.lora_names), random.Random(0), engine.model_config.vocab_size
    ids = [f"b{batch}-s{spread}-{next(REQUEST_IDS)}" for _ in range(batch)]
    for i, request_id in enumerate(ids):
        params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - args.context, ignore_eos=True,
                                detokenize=False, lora=names[i % spread] if spread else None)
        engine.reserve_import(request_id, [rng.randrange(3, vocab) for _ in range(args.context)], params)
        engine.complete_import(request_id, rng.randrange(3, vocab))
    for _ in range(args.warm_up):
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    ran = len({seq.adapter_slot for seq in engine.policy.running} - {-1})  # the adapters its sequences run under
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():  # an iteration async scheduling queued ahead
        engine.step()
    return {"batch": batch, "spread": spread, "adapters_in_step": ran, "rank": args.rank,
            "context": args.context, "graphs": args.device == "cuda" and batch <= args.cuda_graph_max_batch,
            "step_ms": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", choices=["small", *SHAPES], help="the model's shape (small: "
                   "Llama-3's, 1024 wide and 4 layers deep)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batches", default="1,16,64", help="running sequences per step")
    p.add_argument("--spreads", default="0,1,4,16", help="adapters the batch takes in turn (0: the base model)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="tokens of context each sequence enters with")
    p.add_argument("--warm-up", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of the sweep, interleaved")
    p.add_argument("--cuda-graph-max-batch", type=int, default=256, help="CUDA: decode steps of up to this many "
                   "sequences replay graphs (0: every step eager)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device takes cpu, or cuda where there is one; got {args.device}")
    spreads = [int(s) for s in args.spreads.split(",")]
    shape = SMALL if args.shape == "small" else SHAPES[args.shape]
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_checkpoint(Path(tmp) / "model", shape)
        config = ModelConfig.from_hf(shape)
        adapters = {f"a{i}": write_adapter(Path(tmp) / f"a{i}", config, list(projection_shapes(config)), args.rank, i)
                    for i in range(max(spreads))}
        engine = build_engine(model_dir, adapters, max(batches), args)
        for batch in batches:
            runs = {spread: [] for spread in spreads}
            for _ in range(args.repeats):
                for spread in spreads:
                    runs[spread].append(measure(engine, batch, spread, args))
            for spread in spreads:
                times = sorted(run["step_ms"] for run in runs[spread])
                row = {**runs[spread][-1], "step_ms": statistics.median(times), "step_ms_min": times[0],
                       "step_ms_max": times[-1]}
                base = statistics.median(run["step_ms"] for run in runs[0]) if 0 in runs else None
                row["vs_base"] = None if base is None else row["step_ms"] / base
                rows.append(row)
                print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    result = {"device": device, "shape": args.shape, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
