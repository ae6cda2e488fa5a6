"""Seeded random weights for any config (vLLM's `--load-format dummy`), and checkpoint
directories that hold a model's shape alone, for benchmarks and tests."""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from splitserve.engine import fp8, mxfp4
from splitserve.engine.loader import tensor_key
from splitserve.engine.model.llama import RMSNorm, checkpoint_tensors, shard_slices

DUMMY_STD = 0.02
DUMMY_CHUNK = 1 << 22  # dummy values drawn with one generator (16 MiB of float32)


def init_dummy_weights(model: nn.Module, seed: int, runs: bool = True) -> None:
    """Seeded random weights for any config (vLLM's `--load-format dummy`).

    Biases get zeros, other 1-D parameters (norm weights) ones (Gemma's, which scale by 1 + weight,
    zeros), matrices and embeddings normal(0, 0.02); MXFP4 experts uniformly random codes, every
    scale `mxfp4.DUMMY_SCALE`; FP8 weights (experts, kept projections) the codes of normal(0, 0.02)
    at `fp8.DUMMY_SCALE`; packed integers (kept projections) uniformly random words, zero points too,
    their scales `fp8.DUMMY_SCALE` (4-bit weights within 15/256 of 0). Values are drawn on the CPU
    in float32 (MXFP4 codes and packed words as bytes), so a seed gives the same weights on every
    device and dtype (a prompt worker on one kind of GPU, its token worker on another).
    `runs`: each run of DUMMY_CHUNK values has a generator of its own, seeded by (seed, tensor name,
    offset), and torch's threads draw the runs at once (an 8B model's 8e9 values take about a
    minute on one core); without it one generator draws every tensor in turn (the demo model's
    weights, fixed since it was made). A tensor-parallel rank draws each whole tensor and keeps its
    part, so every TP size holds the same model.
    """
    gen, done, parts = torch.Generator().manual_seed(seed), set(), shard_slices(model)
    offset_norms = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RMSNorm) and m.gemma}
    with torch.no_grad(), ThreadPoolExecutor(torch.get_num_threads()) as pool:  # normal_ releases the GIL
        for name, param in checkpoint_tensors(model):
            if tensor_key(param) in done:  # a tied weight, drawn once
                continue
            done.add(tensor_key(param))
            if name.endswith("bias"):
                param.zero_()
            elif name.endswith("_scales"):
                param.fill_(mxfp4.DUMMY_SCALE)
            elif name.endswith(fp8.SCALE_SUFFIXES):
                param.fill_(fp8.DUMMY_SCALE)
            elif param.dim() == 1:
                param.fill_(0.0 if name in offset_norms else 1.0)
            else:
                part = parts.get(name)
                shape = part.full_shape(param.shape) if part else param.shape
                full = _values(shape, param.dtype)
                if runs:
                    _random_runs(full, seed, name, pool)
                else:
                    _draw(full, gen)
                if param.dtype == torch.float8_e4m3fn:  # codes of those values at fp8.DUMMY_SCALE
                    full /= fp8.DUMMY_SCALE
                if param.dtype == torch.int32:  # packed integers: random bytes, as words
                    full = full.view(torch.int32)
                param.copy_(part.take(full) if part else full)


def _values(shape, dtype: torch.dtype) -> torch.Tensor:
    """Where a parameter's values are drawn: bytes for a uint8 one (MXFP4 codes) or an int32 one (four
    a word: packed integers), float32 otherwise."""
    if dtype == torch.int32:
        return torch.empty((*shape[:-1], shape[-1] * 4), dtype=torch.uint8)
    return torch.empty(shape, dtype=torch.uint8 if dtype == torch.uint8 else torch.float32)


def _draw(values: torch.Tensor, gen: torch.Generator) -> None:
    """normal(0, DUMMY_STD) floats, or uniformly random bytes, in place."""
    if values.dtype == torch.uint8:
        values.random_(0, 256, generator=gen)
    else:
        values.normal_(0.0, DUMMY_STD, generator=gen)


def _random_runs(full: torch.Tensor, seed: int, name: str, pool: ThreadPoolExecutor) -> None:
    """`_draw` into `full`, each run of DUMMY_CHUNK values from its own generator."""
    flat = full.view(-1)

    def draw(start: int) -> None:
        key = hashlib.blake2b(f"{seed}/{name}/{start}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)  # a seed is below 2**63
        _draw(flat[start:start + DUMMY_CHUNK], gen)

    list(pool.map(draw, range(0, flat.numel(), DUMMY_CHUNK)))


def write_shape_checkpoint(root: str | Path, config: dict) -> str:
    """A checkpoint directory of a model's shape alone for load_format="dummy": real shapes, no
    weights, for benchmarks and tests. Its tokenizer.json names every id of the vocabulary ("t0",
    "t1", ...; decoded text joins them with spaces), so what a random model samples detokenizes as
    real text does: one word per token, never an empty decode that widens the incremental window."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    return str(root)
