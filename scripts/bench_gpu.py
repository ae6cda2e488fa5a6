"""The engine on a GPU: decode MBU, prefill MFU, offline throughput against `transformers`, and the
same-node KV transfer, on a Llama-3-8B shape (or another of engine/shapes.py: --shape) with dummy
weights (bf16, MXFP4 experts where the shape has them; nothing is downloaded).

    python scripts/bench_gpu.py --json gpu.json     # a CUDA machine: about 10 minutes on one H100
    python scripts/bench_gpu.py --shape gpt-oss-20b --sections decode,prefill --json oss.json
    python scripts/bench_gpu.py --tiny --json t.json  # every section on a tiny shape, on the CPU (tests)

Each section runs in a process of its own (spawned, so one section's GPU memory is gone before the
next starts), every row names the device, and the rows of a section that builds an engine carry
its `startup_s` (weights drawn, memory profiled, kernels compiled, graphs captured):

1. decode: B sequences with C tokens of context each enter the token-policy engine through its
   import path (blocks reserved, the first token given: the KV arrives as from a prompt worker, so
   nothing is prefilled; the cache holds random values), then --steps decode-only steps are timed
   (CUDA graphs replay them; the engine decodes no text, as on a token worker; with async
   scheduling, CUDA's default, also on the CPU: a step queues the next iteration before it
   returns, so a step's time is the period between iterations). Each row also has the device time of the model's forward
   (CUDA events around it) and the rest of the step outside it: the host's work the device waits
   for, plus the LM head and sampling.
   MBU = (weight bytes + KV bytes read per step) / step time / the device's HBM peak. Weight bytes:
   every layer (a sparse layer's experts: those B tokens hit, as uniform routing would), the final
   norm and the LM head (the embedding reads B rows); KV bytes: B x mean context x bytes per token
   (a windowed layer's: its window). Batches 1, 16, 64, 256 at 1k and 4k tokens; a row whose KV
   does not fit in the engine's cache says so instead (`gpu_roofline` counts all of these).
2. prefill: one prompt of N tokens in one step (prefill_first, budget N). MFU = model FLOPs / step
   time / the dense bf16 peak; model FLOPs = 2 N x layer parameters (a sparse layer's top-k
   experts) + 2 x the LM head (the sampled row) + causal attention, 2 N^2 x heads x head size per
   layer (a windowed one's within its window). Prompts past a shape's context are left out. Its
   engine's attention backend is `auto`'s (on a GPU that runs FlashAttention-2, fresh prompts
   take it); each row names it (`attention`).
3. throughput: 64 prompts of 512 tokens, 256 greedy output tokens each, all in flight: ours
   (`LLM.generate`) against `transformers` `generate` (one static batch of 64, the same shape, its
   own random weights, its default attention), median of --repeats runs each after one untimed
   run of the same work (its caches and allocator warm); `throughput_ratio_vs_hf` = ours / theirs
   in output tokens per second. Ours runs the same prompts sampled too, "splitserve sampled"
   (temperature 0.8, top-p 0.9: from 32 rows the sampler's kernel draws them): what sampling
   costs. Each row also has the workload's roofline floor (prefill FLOPs at the compute peak, then
   the decode steps' weight and KV bytes at the HBM peak: `gpu_roofline.throughput_floor_s`) and
   its `floor_share` (floor / seconds), and the result the highest ratio to transformers any
   engine could reach, `throughput_ratio_ceiling_vs_hf` (transformers' seconds / the floor).
4. transfer: a prompt and a token worker (`kv_pair.py`), both on this GPU, the KV written into the
   token worker's cache through CUDA IPC: visible / serialized transfer for 2k and 8k prompts (on a
   GPU the visible part is the layered run's TTFT over the one-shot run's plus the tail from the first
   token to the last layer landing: `kv_pair.py`).
5. prefill-triton: the prefill rows again with `attention_backend: triton` (the Triton kernel
   for fresh prompts too).
6. decode-fp8: the decode rows again over an FP8 KV cache (`kv_cache_dtype: fp8`, a byte a K or
   V value), its KV bytes counted at a byte.
7. decode-sync: the decode rows again with async scheduling off (each iteration built after the
   last one's outputs): what it gains. The last three come last, so a short --budget cuts them first.

Peaks (vendor data sheets, dense bf16 without sparsity) come from the device's name; --hbm-tbs and
--bf16-tflops give others. Targets (an H100, the Llama-3-8B shape): decode MBU >= 60% at batch 1 and
>= 50% at batch 64, prefill MFU >= 50% at 8k, throughput >= 5x transformers, visible transfer <= 10%
of serialized at 8k.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from gpu_report import print_table, report  # this script's folder, as the ones below
from gpu_roofline import peaks, throughput_floor_s
from gpu_step_sections import (decode_section, fp8_decode_section, prefill_section, sync_decode_section,
                               triton_prefill_section)
from gpu_throughput_sections import hf_section, ours_section
from kv_pair import Pair, kv_bytes_per_token, measure

from splitserve.engine.dummy_weights import write_shape_checkpoint
from splitserve.engine.shapes import LLAMA3_8B, SHAPES

TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
MIN_SECTION_S = 60  # with less of the --budget left a section is skipped: start-up alone takes longer


def settings(tiny: bool, shape: str = "llama3-8b") -> dict:
    if tiny:
        return {"config": TINY, "shape": "tiny Llama (dummy)", "engine": {"device": "cpu", "dtype": "float32"},
                "batches": [1, 4], "contexts": [64, 256], "prefill": [128, 512], "in_flight": 4, "prompt": 32,
                "output": 16, "transfer": [128, 512], "transfer_backend": "ipc"}
    config = SHAPES[shape]

    def fits(lengths):  # an engine takes a prompt below its max_model_len, 16 past the longest
        return [n for n in lengths if n + 16 <= config["max_position_embeddings"]]

    name = "Llama-3-8B shape, 128k context" if shape == "llama3-8b" else f"{shape} shape"
    return {"config": config, "shape": f"{name} (dummy weights)", "engine": {"device": "cuda", "dtype": "bfloat16"},
            "batches": [1, 16, 64, 256], "contexts": fits([1024, 4096]), "prefill": fits([2048, 8192]),
            "in_flight": 64, "prompt": 512, "output": 256, "transfer": fits([2048, 8192]), "transfer_backend": "ipc"}


def device_name(engine_args: dict) -> str:
    return torch.cuda.get_device_name() if engine_args["device"] == "cuda" else "cpu"


def transfer_section(model: str, s: dict, args) -> list[dict]:
    element = torch.tensor([], dtype=getattr(torch, s["engine"]["dtype"])).element_size()
    per_token = kv_bytes_per_token(model, element)
    engine_args = {**s["engine"], "load_format": "dummy", "enable_prefix_caching": False,
                   "max_model_len": max(s["transfer"]) + 16,
                   "kv_cache_memory_bytes": 2 * (max(s["transfer"]) + 64) * per_token}  # three engines share the GPU
    pair = Pair(model, s["transfer_backend"], engine_args)
    try:
        rows = [row for n in s["transfer"] for row in measure([pair], model, n, args.repeats, per_token)]
    finally:
        pair.close()
    return [{**row, "section": "transfer", "batch": 1, "context": row["prompt_tokens"], "model": "dummy"}
            for row in rows]


SECTIONS = {"decode": decode_section, "prefill": prefill_section, "throughput-ours": ours_section,
            "throughput-hf": hf_section, "transfer": transfer_section, "prefill-triton": triton_prefill_section,
            "decode-fp8": fp8_decode_section, "decode-sync": sync_decode_section}


def _run_section(name: str, section, model: str, s: dict, args, conn) -> None:
    try:
        if s["engine"]["device"] == "cpu":
            torch.set_num_threads(1)
        conn.send(section(model, s, args))
    except Exception:
        conn.send([{"section": name, "error": traceback.format_exc()}])


def run_section(name: str, model: str, s: dict, args, timeout: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_section, args=(name, SECTIONS[name], model, s, args, send), daemon=False)
    proc.start()
    send.close()  # the child's end alone: a child that dies unheard ends the wait at once
    if not receive.poll(timeout):
        proc.kill()
        return [{"section": name, "error": f"no result within {timeout:.0f} s"}]
    try:
        rows = receive.recv()
    except EOFError:
        proc.join(30)
        return [{"section": name, "error": f"its process died (exit code {proc.exitcode})"}]
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: every section, in seconds")
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES), help="the model shape (engine/shapes.py)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per row")
    p.add_argument("--repeats", type=int, default=3, help="prefill, throughput and transfer runs per row")
    p.add_argument("--hbm-tbs", type=float, help="HBM peak in TB/s (default: from the device's name)")
    p.add_argument("--bf16-tflops", type=float, help="dense bf16 peak in TFLOP/s (default: from the device's name)")
    p.add_argument("--section-timeout", type=float, default=900.0, help="seconds a section may take")
    p.add_argument("--budget", type=float, help="seconds the whole run may take: a section gets what is left, "
                                                "and one that would start with under a minute left is skipped")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    names = args.sections.split(",")
    if set(names) - set(SECTIONS):
        p.error(f"--sections takes {', '.join(SECTIONS)}; got {args.sections!r}")
    s = settings(args.tiny, args.shape)
    if s["engine"]["device"] == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --tiny for the CPU version")
    device = device_name(s["engine"])
    hbm_flops = peaks(device, args.hbm_tbs, args.bf16_tflops)
    element = torch.tensor([], dtype=getattr(torch, s["engine"]["dtype"])).element_size()
    floor = throughput_floor_s(s["config"], s["in_flight"], s["prompt"], s["output"], element, *hbm_flops)
    rows, started_at = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_shape_checkpoint(Path(tmp) / "model", s["config"])
        for name in names:  # each section's rows are kept as it ends: a run cut short keeps what it measured
            left = math.inf if args.budget is None else args.budget - (time.monotonic() - started_at)
            got = run_section(name, model, s, args, min(args.section_timeout, left)) if left >= MIN_SECTION_S else [
                {"section": name, "skipped": f"{left:.0f} s of the --budget left"}]
            rows += got
            result = report(rows, device, *hbm_flops, s["shape"], targets=not args.tiny and args.shape == "llama3-8b",
                            throughput_floor=floor)
            if args.json:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
            print(f"section {name}: {json.dumps(got)}", flush=True)
    print_table(result)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
