"""A decode GEMM's launch split over K (the W8A16 and W4A16 GEMMs: `fp8_linear`, `int_linear`). A
decode batch's one row of tiles leaves most multiprocessors idle when the outputs are few (4096
make 32 programs of 128 columns for an H100's 132), so the launch also splits over K: each split
stores its float32 sums, and the tile's last split to finish (a counter a tile) adds them in split
order (the same sum whichever finishes last) and rounds them once. Nothing waits on the host, so
a split launch is captured in a CUDA graph like any other."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_SPLIT_STEPS = 4  # k tiles a split reads at least (a program's fixed cost)
SUMS_SHARE = 4  # a split reads at least this many times the bytes of its tile's float32 sums in weights
MAX_SPLITS = 16
COUNTERS = 4096  # tiles one split launch may have: each counts its splits done (back to 0 after)


@triton.jit
def store_sums(acc, out_ptr, partial_ptr, count_ptr, rows, cols, mask, tokens, n, stride_out, SPLIT: tl.constexpr):
    """Store a program's float32 sums `acc` [rows, cols] of out: rounded to out's dtype, or with
    SPLIT into `partial_ptr` [splits, tokens, n], the tile's last split (`count_ptr`: a zeroed
    counter a tile, put back to 0) adding every split's in order and storing the rounded total."""
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if SPLIT:
        at = rows[:, None] * n + cols[None, :]
        tl.store(partial_ptr + tl.program_id(2) * tokens * n + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's sums stored before the counter says so
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1:  # the tile's last split
            acc = tl.zeros_like(acc)
            for split in range(0, tl.num_programs(2)):  # from L2 (.cg): an L1 may hold an earlier launch's sums
                acc += tl.load(partial_ptr + split * tokens * n + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_count(tiles: int, steps: int, sms: int | None, min_steps: int = MIN_SPLIT_STEPS) -> int:
    """Splits over k for a launch of `tiles` tiles over `steps` k tiles on `sms` multiprocessors
    (None: not a GPU, 1): about two programs a multiprocessor, each reading `min_steps` k tiles at least."""
    if sms is None:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // tiles), steps // min_steps))


def plan(tiles: int, k: int, block_m: int, block_k: int, sms: int | None, splittable: bool, weight_bytes: float,
         splits: int | None = None) -> tuple[int, int]:
    """(splits, the k columns each reads) of a launch of `tiles` tiles of `block_m` rows over k in
    `block_k` steps, reading `weight_bytes` a weight (a split at least SUMS_SHARE times its sums'
    bytes): whole k tiles a split, none empty; one where the tile does not split or the launch has
    more tiles than COUNTERS. `splits`: forced (None: `split_count` for `sms`)."""
    steps = triton.cdiv(k, block_k)
    if not splittable or tiles > COUNTERS:
        splits = 1
    elif splits is None:
        least = triton.cdiv(int(SUMS_SHARE * 4 * block_m / weight_bytes), block_k)  # k tiles: sums' bytes / weights'
        splits = split_count(tiles, steps, sms, max(MIN_SPLIT_STEPS, least))
    k_split = triton.cdiv(steps, splits) * block_k
    return triton.cdiv(k, k_split), k_split


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int | None:
    """A CUDA device's multiprocessors, what a decode launch's splits fill; None on other devices."""
    return _cuda_multiprocessors(device.index) if device.type == "cuda" else None


_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's split counters: every launch leaves them 0, and a device's launches run in one
    stream's order. Made by the first launch (the engine's kernel warm-up, before any CUDA graph)."""
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def partials(splits: int, tokens: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """Where a launch's splits store their sums (float32 [splits, tokens, n]); `out` where it does not split."""
    return torch.empty((splits, tokens, n), dtype=torch.float32, device=out.device) if splits > 1 else out
