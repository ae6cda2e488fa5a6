"""Compiles, at start-up, every Triton kernel variant a serving step can launch, so that no step
waits for a compile (about a second each; a cold start compiles a dozen or so). A step's variants
depend only on the model, the dtype and the decode split count (`attention.triton_kernels`), so one
tiny step per split count through the model covers them all: a decode whose context spans enough
key tiles for that many splits, and a two-token chunk after one earlier token (the Triton prefill
kernel, which the flash-attn backend also uses for chunks). Nothing is stored (every slot is
PAD_SLOT), every table names block 0 and the hidden states are dropped. Every rank of a
tensor-parallel group runs the same steps, so their all-reduces pair up. A model with sparse MoE
layers also runs its experts' kernels once per tile size they take (`fused_moe.warm_up_tiles`:
where they are quantized, the 16- and 64-row tiles as stored and, where the engine's largest step
reaches it, dequantized first, as prefills run them), and a model
whose projections stay FP8 runs each shape of them once per launch shape of the W8A16 GEMM
(`fp8_linear.tile_examples`: each tile, and prefills' path, W8A8 or the weight dequantized, where
the engine's largest step reaches it), and one whose projections stay packed integers once per
launch shape of theirs (`int_linear.tile_examples`), whatever the attention backend; and the
sampler's draw (temperature, top-k, top-p, min-p) over the model's vocabulary."""
from __future__ import annotations

import functools
import logging
import time

import torch

from splitserve.engine import triton_sampling
from splitserve.engine.attention.metadata import PAD_SLOT
from splitserve.engine.attention.triton_paged import TritonPagedBackend, split_counts
from splitserve.engine.model import fp8_linear, fused_moe, int_linear
from splitserve.engine.model.linear import Linear
from splitserve.engine.model.moe import SparseMoeBlock
from splitserve.engine.model_runner import ModelRunner, StepBatch

log = logging.getLogger("splitserve.engine")


def warm_up(runner: ModelRunner, max_tokens: int | None = None) -> None:
    """Compile the Triton variants (with a fixed `num_splits`, only that one) that steps of at most
    `max_tokens` tokens launch (None: any); other attention backends have none."""
    warm_up_experts(runner.model, max_tokens)
    warm_up_projections(runner.model, runner.kv_cache.dtype, max_tokens)
    warm_up_sampling(runner.model.config.vocab_size, runner.device)
    backend = runner.backend
    if not isinstance(backend, TritonPagedBackend):
        return
    fixed, start = backend.num_splits, time.perf_counter()
    counts = split_counts() if fixed is None else [fixed]
    try:
        for splits in counts:
            backend.num_splits = splits
            runner.forward(warm_up_step(splits * backend.block_n, runner.kv_cache.block_size,
                                        runner.kv_cache.groups.num_groups))
    finally:
        backend.num_splits = fixed
    log.info("Triton kernels ready on %s: %d warm-up steps (decode split counts %s) in %.1f s, compiling what "
             "Triton's cache (TRITON_CACHE_DIR) lacked", runner.device, len(counts), counts,
             time.perf_counter() - start)


def warm_up_experts(model: torch.nn.Module, max_tokens: int | None = None) -> int:
    """Run the first sparse layer's experts on one token per tile size they take in steps of at most
    `max_tokens`; the number of runs."""
    block = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
    if block is None:
        return 0
    router = block._modules[block.router_name].weight  # [experts, hidden], in the activations' dtype
    x = torch.zeros((1, router.shape[1]), dtype=router.dtype, device=router.device)
    weights = torch.ones((1, block.top_k), device=router.device)
    experts = torch.arange(block.top_k, device=router.device).view(1, -1)
    most = None if max_tokens is None else max_tokens * block.top_k / router.shape[0]
    runs = fused_moe.warm_up_tiles(block.experts.format or "dense", most)
    for block_m, dequantize_first in runs:
        block.experts.fused(x, weights, experts, block_m=block_m, dequantize_first=dequantize_first)
    return len(runs)


def warm_up_projections(model: torch.nn.Module, dtype: torch.dtype, max_tokens: int | None = None) -> int:
    """Run each kept projection shape (input and output features, FP8 blocks or integer scheme) on
    `dtype` activations once per launch shape of its GEMM in steps of at most `max_tokens`; the
    number of runs."""
    shapes = {(m.in_features, m.out_features, m.fp8_block, m.ints): m for m in model.modules()
              if isinstance(m, Linear) and m.kept}
    runs = 0
    for linear in shapes.values():
        gemm = fp8_linear if linear.ints is None else int_linear
        device = (linear.weight if linear.ints is None else linear.weight_packed).device
        for tokens in gemm.tile_examples(max_tokens):
            linear.fused(torch.zeros((tokens, linear.in_features), dtype=dtype, device=device))
            runs += 1
    return runs


def warm_up_sampling(vocab: int, device: torch.device) -> None:
    """Draw from a row of the vocabulary with top-k, top-p and min-p: the sampler's kernel
    (`triton_sampling`) has one variant a vocabulary."""
    one = functools.partial(torch.full, (1,), device=device)
    triton_sampling.draw(torch.zeros((1, vocab), device=device), one(0, dtype=torch.long), one(1.0), [1], [0.5], [0.1],
                         one(0.5), one(0, dtype=torch.long))


def warm_up_step(decode_context: int, block_size: int, groups: int) -> StepBatch:
    width = -(-decode_context // block_size)
    return StepBatch(token_ids=[0] * 3, positions=[0] * 3, slots=[[PAD_SLOT] * 3] * groups, query_starts=[0, 1, 3],
                     context_lens=[decode_context, 3], block_tables=torch.zeros((groups, 2, width), dtype=torch.long),
                     num_decodes=1)
