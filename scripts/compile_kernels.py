"""Compiles, on a machine without a GPU, every variant of the Triton kernels that the CUDA engine
launches for a model shape, for a GPU architecture; reports each variant's compile time,
registers, spills and shared memory (from the cubin, with the cuobjdump that Triton ships) and
its innermost loops' instructions by kind and how far ahead they copy what they load
(`sass_loops.py`: an attention kernel's loop is over key tiles).

Triton compiles a kernel once per variant: per constexpr set, and per integer argument that is 1
or a multiple of 16 and per pointer that is 16-byte aligned, unless the kernel says not to
specialize them. A variant first met while serving stalls that step for its compile. So the
engine's start-up runs first (`kernel_warm_up` and the CUDA-graph capture, as `build_shard` runs
them; not the memory profile, which a configured KV size skips), then a seeded serving mix
(prefills, chunks at offsets, mixed and decode-only steps of every batch size, short and long
contexts) through the real model runner, step inputs, graphs and attention backend, with one
decoder layer's launches standing in for the model (`LayerLaunches`), and the sampler's draw (temperature,
top-k, top-p, min-p) over batches of the vocabulary.

Exits non-zero if a variant spills registers, needs more shared memory than the architecture
gives a block, or is first compiled while serving.

    python scripts/compile_kernels.py --arch 90 --json kernels.json
    python scripts/compile_kernels.py --shape qwen3-30b-a3b   # with the fused-MoE kernels
    python scripts/compile_kernels.py --kv-cache-dtype fp8    # attention over an FP8 cache
    python scripts/compile_kernels.py --max-loras 4           # decode graphs with LoRA adapter slots
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted: read when the kernels are defined

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from sass_loops import describe, disassemble, innermost_loops  # noqa: E402  (this script's folder)

from splitserve.engine import fp8, sampler  # noqa: E402
from splitserve.engine.attention.fp8_kv import KV_CACHE_DTYPES  # noqa: E402
from splitserve.engine.attention.metadata import AttentionMetadata  # noqa: E402
from splitserve.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from splitserve.engine.config import ModelConfig  # noqa: E402
from splitserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from splitserve.engine.engine_config import EngineConfig  # noqa: E402
from splitserve.engine.kernel_warm_up import warm_up  # noqa: E402
from splitserve.engine.kv_cache import KVCache  # noqa: E402
from splitserve.engine.model import fp8_w8a8, split_k  # noqa: E402
from splitserve.engine.model.linear import Linear, MergedLinear  # noqa: E402
from splitserve.engine.model.llama import LlamaAttention, LlamaMLP  # noqa: E402
from splitserve.engine.model.lora import LoraSlots  # noqa: E402
from splitserve.engine.model.moe import SparseMoeBlock, expert_names  # noqa: E402
from splitserve.engine.model.moe_routing import route  # noqa: E402
from splitserve.engine.model.triton_lora import add_rows  # noqa: E402
from splitserve.engine.model.triton_ops import add_rms_norm, gated, rotate_in_place  # noqa: E402
from splitserve.engine.model_builder import default_dtype  # noqa: E402
from splitserve.engine.model_runner import ModelRunner, StepBatch  # noqa: E402
from splitserve.engine.shapes import SHAPES  # noqa: E402
from splitserve.engine.triton_sampling import draw  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Arch:
    name: str
    sms: int            # multiprocessors: what the decode kernel's split count is chosen for
    block_shared: int   # bytes of shared memory one block may have (the opt-in maximum)


ARCHS = {90: Arch("H100 / H200 SXM", 132, 227 * 1024), 89: Arch("L40S", 142, 99 * 1024),
         80: Arch("A100", 108, 163 * 1024)}


class TargetDriver:
    """Stands in for Triton's CUDA driver: kernels compile for `arch` and are never launched. The
    architecture is the device id, so each one gets its own kernel cache."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device=None) -> None:
        return None


@dataclass
class Variant:
    kernel: str
    spec: str       # the constexprs and specializations that make it a variant
    phase: str      # start-up or serving: when it was first compiled
    compile_s: float
    registers: int
    spill_bytes: int
    shared_bytes: int
    loops: list[dict[str, int | None]]  # per innermost loop: instructions a thread issues an iteration, by kind,
    # and its copy slack (sass_loops.py)


@contextmanager
def compile_only(arch: int, phase: list[str], variants: dict[str, Variant]):
    """Every Triton launch compiles (or finds) its variant and returns without running; a new
    variant is recorded with the phase it was first met in; the W8A16 and W4A16 GEMMs split their decode tiles
    for `arch`'s multiprocessors, and prefills' FP8 projections run W8A8 where `arch` has FP8 tensor
    cores. Triton's driver stays `arch`'s for the rest of the process (without a GPU there is no
    other to go back to)."""
    real_run, real_multiprocessors, real_capability = JITFunction.run, split_k.multiprocessors, fp8_w8a8.capability

    def run(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel.hash not in variants:
            variants[kernel.hash] = _variant(self, kernel, phase[0], time.perf_counter() - start)
        return kernel

    driver.set_active(TargetDriver(arch))
    JITFunction.run = run
    split_k.multiprocessors = lambda device: ARCHS[arch].sms
    fp8_w8a8.capability = lambda device: divmod(arch, 10)
    try:
        yield
    finally:
        JITFunction.run, split_k.multiprocessors, fp8_w8a8.capability = real_run, real_multiprocessors, \
            real_capability


@contextmanager
def built_for(capability: tuple[int, int]):
    """Models built inside keep quantized weights as on a device of `capability` (`fp8.build_capability`)."""
    real = fp8.build_capability
    fp8.build_capability = lambda: capability
    try:
        yield
    finally:
        fp8.build_capability = real


def _variant(fn: JITFunction, kernel, phase: str, seconds: float) -> Variant:
    names = fn.arg_names
    declared = {p.name for p in fn.params if p.is_constexpr}
    spec = [f"{names[path[0]]}={value}" for path, value in kernel.src.constants.items()
            if names[path[0]] in declared]
    spec += [f"{names[path[0]]}==1" for path in kernel.src.constants if names[path[0]] not in declared]
    spec += [f"{names[path[0]]}%16" for path, attrs in kernel.src.attrs.items()
             if any(name == "tt.divisibility" for name, _ in attrs)]
    usage = _resource_usage(kernel.asm["cubin"])
    return Variant(kernel.name, " ".join(spec), phase, round(seconds, 3), usage["REG"],
                   usage["STACK"] + usage["LOCAL"], kernel.metadata.shared,
                   innermost_loops(_sass(kernel)))


def _sass(kernel) -> str:
    """The variant's SASS, kept in Triton's cache beside its cubin: a start on a warm cache runs no
    nvdisasm (half a second each, however small the kernel)."""
    cache, name = get_cache_manager(kernel.hash), f"{kernel.name}.sass"
    path = cache.get_file(name) or cache.put(disassemble(kernel.asm["cubin"]), name, binary=False)
    return Path(path).read_text()


def _resource_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = out.strip().splitlines()[-1].split()  # "REG:116 STACK:0 SHARED:1024 LOCAL:0 ..."
    return {k: int(v) for k, v in (f.split(":") for f in fields if f.split(":")[1].isdigit())}


class LayerLaunches(torch.nn.Module):
    """One Llama decoder layer's Triton launches on CUDA, in its order and with its tensors'
    shapes and strides, without the cuBLAS matmuls (their results are only allocated): the norm
    without and with the residual, the rotary embedding of q and k (views of the fused QKV output),
    attention (once per `windows`, the model's kinds of layer: with its sliding window, whole
    context), a sparse layer's experts (every token on its first k experts), and the W8A16 GEMM of
    each projection the device keeps FP8 (the integer GEMM of one kept packed), and with `lora`
    (slots, rank) each projection's adapters by row where the CUDA graphs set the rows. Called as
    the model is, by the model runner and the CUDA graphs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_model_len: int, windows: list[int | None],
                 lora: tuple[int, int] = (0, 0)):
        super().__init__()
        self.windows = windows
        with torch.device("meta"):
            self.attention = LlamaAttention(config)
            self.mlp = None if config.is_moe_layer(0) else LlamaMLP(config)
        for linear in self._projections():  # kept FP8 or packed: allocated on the CPU, never written
            linear.to_empty(device="cpu")
        self.config, self.dtype = config, dtype
        self.lora_slots = LoraSlots(*lora)  # the runner and the graphs ask the model for its adapter slots
        self._adapters = {linear: self._adapter_weights(linear, *lora) for linear in self._linears()}
        self.sinks = torch.zeros(self.attention.num_heads, dtype=dtype) if config.attention_sinks else None
        self.weight = torch.empty(config.hidden_size, dtype=dtype)
        self.cos = self.sin = torch.empty((max_model_len, config.head_dim), dtype=torch.float32)
        self.moe = None
        if config.is_moe_layer(0):  # its weights allocated on the CPU, never written (no pages touched)
            with torch.device("meta"), default_dtype(dtype):  # FP8 or MXFP4 experts keep their own dtypes
                self.moe = SparseMoeBlock(config, expert_names(config))
            self.moe.to_empty(device="cpu")

    def __call__(self, ids, positions, kv_layers, metas: list[AttentionMetadata], backend, after_layer=None):
        t, c, attention, meta = ids.shape[0], self.config, self.attention, metas[0]
        x = torch.empty((t, c.hidden_size), dtype=self.dtype)
        h, _ = add_rms_norm(x, None, self.weight, c.rms_norm_eps, c.gemma_norms)
        q, k, v = attention.heads(*attention.qkv_proj.split(self._project(attention.qkv_proj, h)))
        weight = torch.empty(c.head_dim, dtype=self.dtype)
        norms = None if attention.q_norm is None else (weight, weight, c.rms_norm_eps, c.gemma_norms)  # Qwen3's q, k
        rotate_in_place(positions, q, k, self.cos, self.sin, norms, c.rotary_interleaved)
        for window in self.windows:
            backend.forward(q, k, v, kv_layers[0], meta, window, attention.scale, attention.softcap, self.sinks,
                            attention.kv_scale)
        self._project(attention.o_proj, torch.empty((t, attention.o_proj.in_features), dtype=self.dtype))
        h, _ = add_rms_norm(x, h, self.weight, c.rms_norm_eps, c.gemma_norms)
        if self.moe is not None:
            k = self.moe.top_k
            # the routing launched as the engine launches it; the experts take fixed ids (nothing runs here)
            route(torch.empty((t, c.num_experts), dtype=self.dtype), k, self.moe.renormalize)
            self.moe.experts.fused(h, torch.ones((t, k)), torch.arange(k).repeat(t, 1))
        elif self.mlp.act_fn is not None:  # an MLP without a gate: its activation torch's, no kernel
            self._project(self.mlp.down_proj, self._project(self.mlp.gate_up_proj, h))
        else:
            gate, up = self.mlp.gate_up_proj.split(self._project(self.mlp.gate_up_proj, h))
            self._project(self.mlp.down_proj, gated(gate, up, self.mlp.gelu))
        return h

    def _linears(self) -> list[Linear]:
        found = [self.attention.qkv_proj, self.attention.o_proj]
        return found + ([self.mlp.gate_up_proj, self.mlp.down_proj] if self.mlp is not None else [])

    def _projections(self) -> list[Linear]:
        """The projections kept FP8 or packed."""
        return [linear for linear in self._linears() if linear.kept]

    def _adapter_weights(self, linear: Linear, slots: int, rank: int) -> tuple | None:
        """A [slots, parts * rank, in], B [slots, out, rank] and the parts' rows (never written)."""
        if not slots:
            return None
        parts = list(linear.parts.values()) if isinstance(linear, MergedLinear) else [linear.out_features]
        return (torch.empty((slots, len(parts) * rank, linear.in_features), dtype=self.dtype),
                torch.empty((slots, linear.out_features, rank), dtype=self.dtype), parts)

    def _project(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        out = linear.fused(x) if linear.kept else \
            torch.empty((x.shape[0], linear.out_features), dtype=self.dtype)
        if self.lora_slots.rows is not None:  # a captured decode step of a model with adapter slots
            a, b, parts = self._adapters[linear]
            add_rows(x, out, a, b, self.lora_slots.rows, parts)
        return out


def step(seqs: list[tuple[int, int]], block_size: int, groups: int) -> StepBatch:
    """A step of (context after the step, new tokens) per sequence, decodes first, as the model
    runner prepares it (slots and block ids are arbitrary: nothing runs)."""
    seqs = sorted(seqs, key=lambda s: (s[1] != 1, -s[0]))
    tokens, positions, starts = [], [], [0]
    for context, new in seqs:
        positions += range(context - new, context)
        tokens += [0] * new
        starts.append(starts[-1] + new)
    blocks = torch.tensor([-(-context // block_size) for context, _ in seqs])
    columns = torch.arange(int(blocks.max()))
    tables = torch.where(columns < blocks[:, None], columns, 0)  # a sequence's blocks, then zeros
    return StepBatch(tokens, positions, [list(range(len(tokens)))] * groups, starts, [c for c, _ in seqs],
                     tables[None].repeat(groups, 1, 1), sum(1 for _, new in seqs if new == 1))


def serving_mix(rng: random.Random, config: EngineConfig, max_model_len: int, steps: int):
    """Decode-only steps of every batch size up to max_num_seqs, then random prefill, chunked and
    mixed steps within the chunk budget, contexts short and long."""
    longest = min(max_model_len, 32768)
    for n in range(1, config.max_num_seqs + 1):
        yield [(rng.randint(2, rng.choice([64, 1024, longest])), 1) for _ in range(n)]
    for _ in range(steps):
        decodes = rng.choice([0, 0, 1, rng.randint(2, config.max_num_seqs - 1)])
        seqs = [(rng.randint(2, rng.choice([64, 2048, longest])), 1) for _ in range(decodes)]
        budget = config.chunk_token_budget - decodes
        while budget > 0 and len(seqs) < config.max_num_seqs:
            new = rng.randint(1, budget)
            earlier = rng.choice([0, 0, rng.randint(1, longest - new)])  # a later chunk, or a prefix-cache hit
            seqs.append((earlier + new, new))
            budget -= new
        yield seqs


def compile_all(arch: int, shape: dict, dtype: torch.dtype, config: EngineConfig, steps: int,
                with_warm_up: bool = True, seed: int = 0, decode_stages: int | None = None) -> list[Variant]:
    """`config.max_loras` and `max_lora_rank`: the decode graphs with that many adapter slots."""
    whole = ModelConfig.from_hf(shape)
    model_config = replace(whole, num_hidden_layers=1)
    max_model_len = config.max_model_len or model_config.max_positions
    windows = sorted({whole.window_of(i) for i in range(whole.num_hidden_layers)}, key=lambda w: w or 0)
    with built_for(divmod(arch, 10)):  # FP8 weights kept (or dequantized) as that device keeps them
        model = LayerLaunches(model_config, dtype, max_model_len, windows, (config.max_loras, config.max_lora_rank))
    cpu = torch.device("cpu")
    backend = TritonPagedBackend(sms=ARCHS[arch].sms, capability=divmod(arch, 10),
                                 shared_bytes=ARCHS[arch].block_shared, decode_stages=decode_stages)
    cache = KVCache(model_config, 8, config.block_size, dtype, cpu, kv_cache_dtype=config.kv_cache_dtype)
    runner = ModelRunner(model, cache, backend, cpu)
    phase, variants = ["start-up"], {}
    with compile_only(arch, phase, variants), torch.inference_mode():
        if with_warm_up:
            warm_up(runner)  # then the graphs, as build_shard does (without a GPU a capture runs at its first replay)
        graphs = DecodeGraphs(runner, backend, min(config.cuda_graph_max_batch, config.max_num_seqs), max_model_len)
        graphs.capture()
        for size in graphs.sizes:
            graphs.run(step([(2, 1)] * size, config.block_size, cache.groups.num_groups))
        runner.graphs = graphs
        phase[0] = "serving"
        for seqs in serving_mix(random.Random(seed), config, max_model_len, steps):
            runner.forward(step(seqs, config.block_size, cache.groups.num_groups))
        for rows in sorted({1, sampler.KERNEL_ROWS, config.max_num_seqs}):  # the sampler's draws
            draw(torch.zeros((rows, model_config.vocab_size)), torch.arange(rows), torch.ones(rows), [1] * rows,
                 [0.5] * rows, [0.1] * rows, torch.full((rows,), 0.5), torch.zeros(rows, dtype=torch.long))
    return list(variants.values())


def problems(variants: list[Variant], arch: int) -> list[str]:
    limit = ARCHS[arch].block_shared
    found = [f"{v.kernel} [{v.spec}]: {v.spill_bytes} bytes of spilled registers" for v in variants if v.spill_bytes]
    found += [f"{v.kernel} [{v.spec}]: {v.shared_bytes} bytes of shared memory, over the {limit} a block may have"
              for v in variants if v.shared_bytes > limit]
    found += [f"{v.kernel} [{v.spec}]: first compiled while serving" for v in variants if v.phase == "serving"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), action="append",
                        help="compute capability x10 (repeatable; default 90 and 80)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shape", default="llama3-8b",
                        help=f"a config.json, or one of {', '.join(SHAPES)} (default: llama3-8b)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="fp8: the attention kernels' variants that read e4m3 codes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=0, help="LoRA adapter slots (their kernels run in the decode "
                        "graphs)")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="random prefill / mixed steps of the serving mix")
    parser.add_argument("--decode-stages", type=int, help="the decode kernel's pipelining stages (default: the "
                        "engine's, 5 over an FP8 cache and 3 over others)")
    parser.add_argument("--no-warm-up", action="store_true", help="start up without kernel_warm_up (what it saves)")
    parser.add_argument("--cache-dir", type=Path, help="Triton's cache to compile into (default: a fresh one, so the "
                        "times are a cold start's; give the same one twice to time a warm start)")
    parser.add_argument("--json", type=Path, help="write the variants here")
    args = parser.parse_args(argv)
    shape = SHAPES.get(args.shape) or json.loads(Path(args.shape).read_text())
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          kv_cache_dtype=args.kv_cache_dtype, max_loras=args.max_loras,
                          max_lora_rank=args.max_lora_rank)
    report, failed = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "archs": {}}, False
    os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir or tempfile.mkdtemp(prefix="splitserve-triton-"))
    for arch in args.arch or [90, 80]:
        variants = compile_all(arch, shape, DTYPES[args.dtype], config, args.steps, not args.no_warm_up,
                               decode_stages=args.decode_stages)
        found = problems(variants, arch)
        failed |= bool(found)
        report["archs"][f"sm_{arch}"] = {"device": ARCHS[arch].name, "variants": [v.__dict__ for v in variants],
                                         "problems": found}
        print(f"sm_{arch} ({ARCHS[arch].name}), {args.dtype}, KV {args.kv_cache_dtype}: {len(variants)} variants, "
              f"{sum(v.compile_s for v in variants):.1f} s of compiling on this machine")
        for v in variants:
            print(f"  {v.phase:8} {v.kernel:22} {v.compile_s:6.2f} s  {v.registers:3} regs  {v.spill_bytes:4} B spilled"
                  f"  {v.shared_bytes:6} B shared  {v.spec}")
            if v.loops:
                print(f"{'':12}loops: {describe(v.loops)}")
        for line in found:
            print("  PROBLEM:", line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
