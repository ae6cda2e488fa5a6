"""W8A8 for an FP8 checkpoint's dense projections in prefills, on GPUs with FP8 tensor cores (Ada
and Hopper, sm_89 on, where they run at twice bf16's rate): the activations are quantized to e4m3
on the fly, per token and GROUP columns (one float32 scale each: the group's largest magnitude /
448, so its largest value is a code of 448), and the tensor cores multiply codes by codes. Each k
step is one group wide and lies within one block of the weight's columns, so its float32 dot is
scaled by the activations' group scales and the weight's block scales before it joins the float32
accumulator (the products of a step are exact, and no step's sum runs in the tensor cores'
narrower FP8 accumulation for long). This is how Hugging Face `transformers` and vLLM run these
checkpoints on such GPUs; per-128-column scales are at least as fine as any checkpoint's own
activation scheme (per token or per tensor), so a static scheme's `input_scale` is not needed.

The oracle (`reference`) quantizes the activations the same way in torch (`quantize_reference`,
bit for bit the kernel's codes and scales) and multiplies the dequantized values in float64; on
CPU the kernels run only under Triton's interpreter (how the tests check them).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from splitserve.engine import fp8
from splitserve.engine.triton_e4m3 import e4m3_codes

GROUP = 128  # activation columns a scale covers: the GEMM's k step, within one block of the weight's columns
E4M3_MAX = 448.0
MIN_AMAX = 1e-10  # an all-zero group's scale is this / 448, not 0 (its codes are 0 either way)
CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on
QUANTIZE_ROWS = 32  # tokens a quantizing program reads, one group of columns each
TILE = (128, 128, 8, 3)  # BLOCK_M, BLOCK_N, warps, pipeline stages (three 32 KiB stages of A and W codes)
SWIZZLE = 8  # row tiles a column of programs covers before the next weight tile (L2 reuse of the weight)


@triton.jit(do_not_specialize=["tokens"])
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, tokens, k, stride_x, stride_codes, ROWS: tl.constexpr,
                     GROUP: tl.constexpr, MIN_AMAX: tl.constexpr):
    """One program per (ROWS tokens, group of columns): codes [tokens, k] (uint8 e4m3) of x divided
    by each token's group scale, and the scales [groups, tokens] (a group's tokens contiguous)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    valid = rows < tokens
    mask = valid[:, None] & (cols < k)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), MIN_AMAX), 448.0)
    codes = e4m3_codes(tl.math.div_rn(x, scale[:, None]))
    tl.store(codes_ptr + rows[:, None] * stride_codes + cols[None, :], codes, mask=mask)
    tl.store(scales_ptr + tl.program_id(1) * tokens + rows, scale, mask=valid)


@triton.jit(do_not_specialize=["tokens"])
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, tokens, n, k, stride_a, stride_w, stride_ws, stride_out,
                 block_rows, block_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                 SWIZZLE: tl.constexpr, W_SCALES: tl.constexpr, EVEN_K: tl.constexpr):
    """One program per (BLOCK_M tokens, BLOCK_N outputs), in column-of-tiles order (SWIZZLE row
    tiles share each weight tile while it is in L2): out = sum over k steps of
    dot(codes of a, codes of W.T) * a's group scales * W's block scales. W_SCALES says how W's
    scales vary over a tile: "tile" (one block of rows holds the tile's outputs: a scale a k step),
    "column" (one block of columns holds every k: a scale an output, applied once at the end), or
    "block" (each output's own at each k step). Rows and outputs past the ends read row 0's and
    output 0's (any valid address), and are not stored."""
    row_tiles, col_tiles = tl.cdiv(tokens, BLOCK_M), tl.cdiv(n, BLOCK_N)
    pid = tl.program_id(0)
    first_row_tile = (pid // (SWIZZLE * col_tiles)) * SWIZZLE
    band_rows = tl.minimum(row_tiles - first_row_tile, SWIZZLE)
    row_tile = first_row_tile + (pid % (SWIZZLE * col_tiles)) % band_rows
    col_tile = (pid % (SWIZZLE * col_tiles)) // band_rows
    rows = (row_tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid, col_ok = rows < tokens, cols < n
    group = tl.arange(0, GROUP)
    a_ptrs = a_ptr + tl.where(valid, rows, 0)[:, None] * stride_a + group[None, :]
    w_ptrs = w_ptr + tl.where(col_ok, cols, 0)[None, :].to(tl.int64) * stride_w + group[:, None]
    as_ptrs = as_ptr + tl.where(valid, rows, 0)
    if W_SCALES == "tile":
        ws_ptrs = ws_ptr + (col_tile * BLOCK_N // block_rows) * stride_ws
    else:
        ws_ptrs = ws_ptr + (tl.where(col_ok, cols, 0) // block_rows) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(k, GROUP)):
        if EVEN_K:
            a, w = tl.load(a_ptrs), tl.load(w_ptrs)
        else:
            k_ok = step * GROUP + group < k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        a_scale = tl.load(as_ptrs + step * tokens)
        if W_SCALES == "tile":
            acc += tl.dot(a, w) * (a_scale * tl.load(ws_ptrs + step * GROUP // block_cols))[:, None]
        elif W_SCALES == "column":
            acc += tl.dot(a, w) * a_scale[:, None]
        else:
            acc += tl.dot(a, w) * (a_scale[:, None] * tl.load(ws_ptrs + step * GROUP // block_cols)[None, :])
        a_ptrs += GROUP
        w_ptrs += GROUP
    if W_SCALES == "column":
        acc = acc * tl.load(ws_ptrs)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def w_scales_mode(block: tuple[int, int], k: int, block_n: int) -> str:
    """How a weight's scales vary over a `block_n`-output tile (`_w8a8_kernel`'s W_SCALES)."""
    if block[0] % block_n == 0:
        return "tile"
    return "column" if block[1] >= k else "block"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None on other devices."""
    return _capability(device.index) if device.type == "cuda" else None


def supported(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether a projection with scales of `block` runs W8A8 on `device`: a CUDA GPU with FP8 tensor
    cores, and blocks of whole groups of columns (a row's or a tensor's scale: `fp8.ROWS`)."""
    found = capability(device)
    return found is not None and found >= CAPABILITY and block[1] % GROUP == 0


def runs_on(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether the W8A8 kernels run at all on `device` for `block` (a benchmark's or a test's forced
    path): where `supported`, and on the CPU under Triton's interpreter with whole groups of columns."""
    return supported(device, block) or device.type == "cpu" and block[1] % GROUP == 0


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [T, K] float8 e4m3, scales [ceil(K / GROUP), T] float32) of activations [T, K] (rows
    contiguous): each token's GROUP columns divided by their scale."""
    tokens, k = rows.shape
    codes = torch.empty((tokens, k), dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty((triton.cdiv(k, GROUP), tokens), dtype=torch.float32, device=rows.device)
    if tokens:
        _quantize_kernel[(triton.cdiv(tokens, QUANTIZE_ROWS), scales.shape[0])](
            rows, codes.view(torch.uint8), scales, tokens, k, rows.stride(0), codes.stride(0), ROWS=QUANTIZE_ROWS,
            GROUP=GROUP, MIN_AMAX=MIN_AMAX)
    return codes, scales


def matmul(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           out: torch.Tensor) -> torch.Tensor:
    """`out` [T, N] = rows [T, K] @ W.T, W = `weight` (e4m3 codes [N, K]) times `scale` (float32, one
    per block of `block`, whose columns hold whole groups), the rows quantized by `quantize`."""
    if block[1] % GROUP:
        raise ValueError(f"W8A8 needs weight blocks of whole {GROUP}-column groups, got {block}")
    tokens, k = rows.shape
    n = weight.shape[0]
    if tokens:
        codes, scales = quantize(rows)
        block_m, block_n, warps, stages = TILE
        grid = (triton.cdiv(tokens, block_m) * triton.cdiv(n, block_n),)
        _w8a8_kernel[grid](codes, scales, weight, scale, out, tokens, n, k, codes.stride(0), weight.stride(0),
                           scale.stride(0), out.stride(0), block[0], block[1], BLOCK_M=block_m, BLOCK_N=block_n,
                           GROUP=GROUP, SWIZZLE=SWIZZLE, W_SCALES=w_scales_mode(block, k, block_n),
                           EVEN_K=k % GROUP == 0, num_warps=warps, num_stages=stages)
    return out


def quantize_reference(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` in torch: the same codes and scales."""
    tokens, k = rows.shape
    groups = triton.cdiv(k, GROUP)
    padded = rows.float().new_zeros(tokens, groups * GROUP)
    padded[:, :k] = rows.float()
    amax = padded.view(tokens, groups, GROUP).abs().amax(-1).clamp_min(MIN_AMAX)
    scales = amax / E4M3_MAX
    codes = (padded.view(tokens, groups, GROUP) / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return codes.to(torch.float8_e4m3fn).view(tokens, groups * GROUP)[:, :k].contiguous(), scales.t().contiguous()


def reference(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """What `matmul` computes, in float64: the activations quantized as the kernel quantizes them,
    each times its scale, by the weight's codes times theirs."""
    codes, scales = quantize_reference(rows)
    values = codes.double() * scales.t().double().repeat_interleave(GROUP, 1)[:, :rows.shape[1]]
    return values @ fp8.dequantize(weight, scale, block, torch.float64).t()
