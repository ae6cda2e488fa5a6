"""The kernels a decode step's forward launches on a GPU (what its CUDA graph holds), counted on
the CPU: the model's own code with the CUDA path's kernels taken (`triton_dispatch`, the Triton
attention backend; the Triton kernels interpreted), every Triton launch and every torch op that
is a kernel on CUDA (views, allocations and other metadata ops are not) counted once.

Each shape is cut to tiny widths (a launch count does not depend on them) and built with one
layer and with two: their difference is a layer's launches, the rest the step's outside the
layers (the embedding, the final norm). B sequences decode together after a short prompt, so a
sparse layer's assignments (B x top k) take the one-launch grouping, as decodes do.

    python scripts/count_launches.py --json launches.json      # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import GridExecutor  # noqa: E402

from splitserve.engine.dummy_weights import write_shape_checkpoint  # noqa: E402
from splitserve.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.engine.model import triton_dispatch  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from splitserve.engine.shapes import SHAPES  # noqa: E402

# aten ops that launch nothing on CUDA: views, allocations, metadata
FREE = {"view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "split",
        "split_with_sizes", "unbind", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand", "detach",
        "alias", "empty", "empty_strided", "empty_like", "lift_fresh", "view_as", "narrow", "chunk",
        "sym_size", "sym_stride", "sym_numel", "is_same_size", "new_empty", "new_empty_strided", "flatten",
        "promote_types", "result_type", "detach_"}
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}
SHAPE_NAMES = ("llama3-8b", "qwen3-8b", "gemma2-9b", "qwen3-30b-a3b", "gpt-oss-20b")


class Launches(TorchDispatchMode):
    """Counts the kernels launched while it is active: torch ops by name, Triton launches by kernel
    (the interpreter's own tensor copies inside a launch are not launches)."""

    def __init__(self):
        super().__init__()
        self.counts, self._inside_triton = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if not self._inside_triton and name not in FREE and not (name == "to" and out is args[0]):  # `to` its own dtype
            self.counts[f"aten.{name}"] += 1
        return out

    def __enter__(self):
        self._launch = launch = GridExecutor.__call__

        def counted(executor, *args, **kwargs):
            self.counts[executor.fn.__name__] += 1
            self._inside_triton += 1
            try:
                return launch(executor, *args, **kwargs)
            finally:
                self._inside_triton -= 1

        GridExecutor.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        GridExecutor.__call__ = self._launch
        return super().__exit__(*exc)


def tiny(name: str, layers: int) -> dict:
    config = {**SHAPES[name], **TINY, "num_hidden_layers": layers}
    if "moe_intermediate_size" not in SHAPES[name]:
        del config["moe_intermediate_size"]
    if "layer_types" in config:  # GPT-OSS: windowed and full layers alternate
        config["layer_types"] = ["sliding_attention", "full_attention"][:layers]
    config.pop("quantization_config", None)
    return config


def decode_launches(name: str, layers: int, batch: int, root: Path) -> Counter:
    """The launches of one decode step's forward of `batch` sequences."""
    path = write_shape_checkpoint(root / f"{name}-{layers}", tiny(name, layers))
    engine = LLMEngine(path, load_format="dummy", device="cpu", dtype="bfloat16", attention_backend="triton",
                       block_size=16, num_kv_blocks=8 * batch, max_model_len=128, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True).ids_only()
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + (i + j) % 100 for j in range(20)], params)
    engine.step()  # the prompts
    mode, model = Launches(), engine.runner.model
    forward = model.forward

    def counted(*args, **kwargs):  # the model's forward: what a decode step's graph holds (not its inputs' upload)
        with mode:
            return forward(*args, **kwargs)

    model.forward = counted
    engine.step()  # a decode step
    return mode.counts


def count(name: str, batch: int, root: Path) -> dict:
    one, two = decode_launches(name, 1, batch, root), decode_launches(name, 2, batch, root)
    layer = two - one
    outside = one - layer
    return {"shape": name, "batch": batch, "per_layer": sum(layer.values()), "outside_layers": sum(outside.values()),
            "layer_kernels": dict(sorted(layer.items())), "outside_kernels": dict(sorted(outside.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES), help=f"any of {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together (8)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    for_cuda = triton_dispatch.runs_kernels
    triton_dispatch.runs_kernels = lambda x: True  # the CUDA path's kernels, on the CPU
    rows = []
    try:
        with tempfile.TemporaryDirectory() as root:
            for name in args.shapes.split(","):
                rows.append(count(name, args.batch, Path(root)))
                print(f"{name}: {rows[-1]['per_layer']} launches a layer, {rows[-1]['outside_layers']} outside "
                      f"them: {rows[-1]['layer_kernels']}", flush=True)
    finally:
        triton_dispatch.runs_kernels = for_cuda
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "machine": platform.processor() or platform.machine(),
                                         "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
