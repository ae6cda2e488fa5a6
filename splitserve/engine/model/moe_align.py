"""A layer's (token, slot) assignments grouped by expert in whole tiles, for the fused-MoE kernels
(`fused_moe`): which assignments each tile of rows holds, and each tile's expert.

Up to `FUSED_ASSIGNMENTS` (decode steps, small prefills) one Triton program does it all in one
launch, where the torch ops of `align_reference` are about twenty, each a launch, a layer (about
a thousand a Qwen3-30B-A3B decode step). Beyond it (prefills, whose expert GEMMs dwarf a few
launches) the torch ops run. Both give the same tensors; on CPU the kernel runs only under
Triton's interpreter (how the tests check it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FUSED_ASSIGNMENTS = 2048  # up to this many assignments a layer (256 decodes of top 8), one launch aligns them
CHUNK = 32  # assignments (or tiles) a step of the kernel's loops takes
FILL = 1024  # rows a step of its padding fill writes


@triton.jit(do_not_specialize=["count", "tiles"])
def _align_kernel(experts_ptr, sorted_ptr, block_expert_ptr, count, num_experts, tiles, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """One program: `align_reference`'s (sorted, block_expert) of `count` expert ids. A first pass
    counts each expert's assignments, so each group's first row is known (whole tiles each); a
    second pass writes each assignment to its group's next row, in assignment order."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for first in range(0, count, CHUNK):
        counts += tl.sum(_hits(experts_ptr, first, count, e, BLOCK_E, CHUNK), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    for first in range(0, tiles * BLOCK_M, FILL):  # padding rows hold `count`
        rows = first + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.full([FILL], 0, tl.int32) + count, mask=rows < tiles * BLOCK_M)
    for first in range(0, tiles, CHUNK):  # a tile's expert: the groups ending at or before its first row
        t = first + tl.arange(0, CHUNK)
        before = (ends[None, :] <= (t * BLOCK_M)[:, None]) & (e < num_experts)[None, :]
        tl.store(block_expert_ptr + t, tl.sum(before.to(tl.int32), 1), mask=t < tiles)
    tl.debug_barrier()  # the padding is written before any assignment's row
    seen = tl.zeros([BLOCK_E], tl.int32)
    for first in range(0, count, CHUNK):
        hits = _hits(experts_ptr, first, count, e, BLOCK_E, CHUNK)
        earlier = tl.cumsum(hits, 0) - hits  # this chunk's assignments before each, per expert
        row = tl.sum(hits * (starts + seen)[None, :] + hits * earlier, 1)
        i = first + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + row, i, mask=i < count)
        seen += tl.sum(hits, 0)


@triton.jit
def _hits(experts_ptr, first, count, e, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """[CHUNK, BLOCK_E] int32: 1 where assignment first + i goes to expert e (none past `count`)."""
    i = first + tl.arange(0, CHUNK)
    ids = tl.load(experts_ptr + i, mask=i < count, other=BLOCK_E).to(tl.int32)
    return (ids[:, None] == e[None, :]).to(tl.int32)


def tiles_for(count: int, num_experts: int, block_m: int) -> int:
    """Tiles that hold any routing of `count` assignments: count + min(E, count) * (block_m - 1)
    rows (each group padded to whole tiles), rounded up to whole tiles; it depends on T alone."""
    return -(-(count + min(num_experts, count) * (block_m - 1)) // block_m)


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted, block_expert) for experts [T, k]: `sorted` lists the assignments (token * k + slot)
    grouped by expert in expert order, each group padded with T * k to a multiple of block_m;
    `block_expert[b]` is the expert of tile b (sorted[b * block_m:(b + 1) * block_m]), num_experts for
    tiles past the last group. One launch up to FUSED_ASSIGNMENTS assignments, else `align_reference`."""
    flat = experts.flatten()
    count = flat.numel()
    if count > FUSED_ASSIGNMENTS:
        return align_reference(experts, num_experts, block_m)
    tiles = tiles_for(count, num_experts, block_m)
    sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(tiles, dtype=torch.int32, device=flat.device)
    if count:
        _align_kernel[(1,)](flat, sorted_ids, block_expert, count, num_experts, tiles, BLOCK_M=block_m,
                            BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK, FILL=FILL)
    return sorted_ids, block_expert


def align_reference(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` in torch ops: each expert's assignments counted, ranked in assignment order (a stable
    sort) and scattered to its group's rows; each tile's expert found by a search of the groups' ends."""
    flat = experts.flatten()
    count = flat.numel()
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (per_expert + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    grouped = flat[order]
    rank = torch.arange(count, device=flat.device) - (per_expert.cumsum(0) - per_expert)[grouped]
    tiles = tiles_for(count, num_experts, block_m)
    sorted_ids = torch.full((tiles * block_m,), count, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, (ends - padded)[grouped] + rank, order.to(torch.int32))
    tile_starts = torch.arange(0, tiles * block_m, block_m, device=flat.device)
    return sorted_ids, torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
