"""Triton kernels for a sparse MoE layer's experts on CUDA, the scheme of vLLM's fused MoE: the
(token, slot) assignments are grouped by expert, each group padded to whole BLOCK_M tiles
(`align`), and one grouped matmul runs every tile against its expert's weights: gate and up (with
their biases, where the model has them) and the gated activation (`moe.GatedAct`: SiLU, or
GPT-OSS's clamped SwiGLU) in one kernel, down times the routing weight in a second. Each token's k outputs
are then summed. Nothing waits on the host and every shape follows from the batch size alone, so
a decode step with experts is captured in a CUDA graph like any other. MXFP4 experts (`mxfp4.Packed`)
are read as their bytes: per 32-value group, each nibble's E2M1 value times the group's power of two
(rounded to the activations' dtype, as `mxfp4.dequantize` rounds it) meets the even or odd inputs
on the tensor cores. FP8 experts (`fp8.Stacked`) likewise: each code times its block's scale (a k
tile lies within one block's columns), rounded to the activations' dtype; packed integer experts
(`int_weights.Stacked`, W4A16 / W8A16) as `int_linear` reads a weight: each word's values widened to
(value - zero point) x its group's scale in the activations' dtype. From
`DEQUANTIZE_ASSIGNMENTS` an expert (prefills) widening the codes again in every tile costs more
than one pass over them: a quantized stack is dequantized the same way into the activations' dtype,
a chunk of experts at a time (`expert_dequantize`), and the kernels read each chunk as tensors, one
launch a chunk (a tile of another chunk's expert returns at once); FP8 experts on a GPU with FP8 tensor cores run
W8A8 there instead (`fp8_w8a8`): the tokens' activations, then the gated ones, quantized per token
and 128 columns, the kernels multiplying codes by codes (`w8a8_tiles.w8a8_dots`), nothing dequantized.

`moe.experts_reference` is the oracle; on CPU the kernels run only under Triton's interpreter
(how the tests check them). Products accumulate in float32 and each kernel rounds once, where
the oracle rounds gate and up, then the activation, to the activations' dtype.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from splitserve.engine import fp8, int_weights, mxfp4
from splitserve.engine.model import expert_dequantize, fp8_linear, fp8_w8a8
from splitserve.engine.model.fused_moe_kernels import down_kernel, gate_up_kernel
from splitserve.engine.model.moe import SILU, ExpertStack, GatedAct
from splitserve.engine.model.moe_align import align

BLOCK_N = 64
BLOCK_K = fp8.KERNEL_K
# a tile of one expert's assignments: 16 rows while experts average at most 16 each, 128 from LARGE_TILE_ASSIGNMENTS
# on a stack of tensors (or experts dequantized first), 64 between and for stacks read as stored
BLOCK_M_SIZES = (16, 64, 128)
LARGE_TILE_ASSIGNMENTS = 128
PACKED_WIDE_BLOCK_N = 32  # gate-up of a 64-row tile of MXFP4 experts: at 64 (or with 8 warps) it spills on sm_80
# (BLOCK_N of gate-up, of down, BLOCK_K, warps) of each tile over tensors. A prefill's tiles read each k step's
# operands from L2 (an expert's weights serve all its tiles, its rows all the width's), so wider tiles multiply more
# per byte: 64 x 64 gate-up and down tiles with 32-wide k steps made 44 and 32 FLOPs a byte; the 128-row tile, with
# 64 columns of gate and of up and 128 of down, 66 both (gpt-oss-20b's bf16 experts ran at 23% MFU at 8192 tokens on
# the H200, as L2-bound as that). Wider ones spill on sm_80 (docs/results/kernels-compiled.md).
TENSOR_TILES = {16: (BLOCK_N, BLOCK_N, BLOCK_K, 4), 64: (BLOCK_N, BLOCK_N, 64, 4), 128: (64, 128, 64, 8)}
# W8A8's: the same columns, k steps a whole group (128) wide, each step's scaling spread over twice the products
W8A8_TILES = {rows: (gate_up, down, fp8_w8a8.GROUP, warps) for rows, (gate_up, down, _, warps) in TENSOR_TILES.items()}
# from this many assignments an expert (on average) a quantized stack is dequantized, a chunk of experts at a time,
# and the kernels read it as tensors: widening the codes again in every tile costs more there (the H200, gpt-oss-20b's
# experts: MXFP4 3.2 ms at 256 tokens against bf16's 1.0, FP8 2.8 and 10.1 ms at 2048 and 8192 against 2.0 and 7.2,
# before the 128-row tile; a pass over the stack, its codes read and bf16 written, about 0.5 ms)
DEQUANTIZE_ASSIGNMENTS = {"mxfp4": 32, "fp8": LARGE_TILE_ASSIGNMENTS, "int": LARGE_TILE_ASSIGNMENTS}
# how fused_experts runs a stack (`path_for`): codes widened in the kernels, the stack dequantized first,
# codes times codes
PATHS = ("as read", "dequantized", "w8a8")
FORMATS = {mxfp4.Packed: "mxfp4", fp8.Stacked: "fp8", int_weights.Stacked: "int"}  # a quantized stack's; else dense


def block_m_for(assignments: int, num_experts: int, tensors: bool = True) -> int:
    """16-row tiles while experts average at most 16 assignments (decode), 128 from
    LARGE_TILE_ASSIGNMENTS over `tensors` (not a stack read as stored), 64 otherwise."""
    if assignments <= BLOCK_M_SIZES[0] * num_experts:
        return BLOCK_M_SIZES[0]
    return BLOCK_M_SIZES[2] if tensors and assignments >= LARGE_TILE_ASSIGNMENTS * num_experts else BLOCK_M_SIZES[1]


def warm_up_tiles(fmt: str, most_per_expert: float | None = None) -> list[tuple[int, bool]]:
    """(tile rows, dequantized first) of every launch shape a stack of `fmt` may take in steps of at
    most `most_per_expert` assignments an expert on average (None: any): dequantized first only
    where a step reaches DEQUANTIZE_ASSIGNMENTS (the warm-up's transient chunk is then one the memory
    profile's largest step made too), in the 64-row tile only below LARGE_TILE_ASSIGNMENTS."""
    if fmt not in DEQUANTIZE_ASSIGNMENTS:
        return [(block_m, False) for block_m in BLOCK_M_SIZES]
    as_stored = [(block_m, False) for block_m in BLOCK_M_SIZES[:2]]
    if most_per_expert is not None and most_per_expert < DEQUANTIZE_ASSIGNMENTS[fmt]:
        return as_stored
    return as_stored + [(block_m, True) for block_m in BLOCK_M_SIZES[1:]
                        if block_m == BLOCK_M_SIZES[2] or DEQUANTIZE_ASSIGNMENTS[fmt] < LARGE_TILE_ASSIGNMENTS]


def launch_config(block_m: int, fmt: str) -> tuple[int, int, int, int]:
    """(BLOCK_N of gate-up, of down, BLOCK_K, warps) of a `block_m`-row tile over a stack of `fmt`
    ("w8a8": FP8 codes times codes, tiled as tensors are)."""
    if fmt in ("dense", "w8a8"):
        return (TENSOR_TILES if fmt == "dense" else W8A8_TILES)[block_m]
    if block_m == BLOCK_M_SIZES[2]:
        raise ValueError(f"the {block_m}-row tile reads tensors (or experts dequantized first), not {fmt} stacks")
    return PACKED_WIDE_BLOCK_N if fmt == "mxfp4" and block_m == BLOCK_M_SIZES[1] else BLOCK_N, BLOCK_N, BLOCK_K, 4


def _operands(w: ExpertStack) -> tuple:
    """(weights, scales, zero points, stride of an expert, of a row, of a scales expert, of a scales
    row, the rows and columns a scale covers, stride of a zero points expert, of their row, the
    columns a group holds) as the kernels take a stack: a packed one's bytes [E, rows, groups * 16]
    and scales [E, rows, groups], an FP8 one's codes and block scales, packed integers' words,
    scales and zero points (any pointer and strides 0 where a stack has none)."""
    if isinstance(w, mxfp4.Packed):
        blocks, scales = w.blocks, w.scales
        if blocks.stride(3) != 1 or blocks.stride(2) != 16 or scales.stride(2) != 1:
            raise ValueError("fused_experts needs each packed row's bytes and scales contiguous")
        return (blocks, scales, blocks, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1), 1,
                mxfp4.GROUP, 0, 0, 1)
    if isinstance(w, fp8.Stacked):
        codes, scales = w.weight, w.scale
        if codes.stride(2) != 1 or scales.stride(2) != 1 or w.block[1] % BLOCK_K:
            raise ValueError("fused_experts needs FP8 rows contiguous, in blocks of whole k tiles")
        return (codes, scales, codes, codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1), *w.block,
                0, 0, 1)
    if isinstance(w, int_weights.Stacked):
        words, scales, zeros = w.packed, w.scale, w.packed if w.zero is None else w.zero
        if words.stride(2) != 1 or scales.stride(2) != 1 or zeros.stride(2) != 1:
            raise ValueError("fused_experts needs packed integer rows, their scales and zero points contiguous")
        return (words, scales, zeros, words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), 1, 1,
                zeros.stride(0), zeros.stride(1), w.scheme.group_size or w.cols)
    if w.stride(2) != 1:
        raise ValueError("fused_experts needs the hidden (and width) dim contiguous")
    return w, w, w, w.stride(0), w.stride(1), 0, 0, 1, 1, 0, 0, 1


def _int_constants(w: ExpertStack, fmt: str, block_k: int) -> dict:
    """A launch's constants for reading a stack of packed integers as stored (`int_weight_tile`'s):
    INT_BITS 0 for any other format or a chunk dequantized; ONE_GROUP where no k tile straddles a group."""
    if fmt != "int":
        return dict(INT_BITS=0, ZERO=False, ONE_GROUP=False)
    group = w.scheme.group_size or w.cols
    return dict(INT_BITS=w.scheme.bits, ZERO=w.zero is not None, ONE_GROUP=group % block_k == 0 or group >= w.cols)


def _checked_operands(x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, b13: torch.Tensor | None,
                      b2: torch.Tensor | None) -> tuple[tuple, tuple]:
    """The two stacks' kernel operands, every layout checked before any launch."""
    if _format(w2) != _format(w13):
        raise ValueError("fused_experts takes w13 and w2 in one format (tensors, MXFP4, FP8 or packed integers)")
    if x.stride(1) != 1 or any(b is not None and b.stride(1) != 1 for b in (b13, b2)):
        raise ValueError("fused_experts needs the hidden (and width) dim contiguous")
    return _operands(w13), _operands(w2)


def _format(w: ExpertStack) -> str:
    return FORMATS.get(type(w), "dense")


def dequantizes(kind: str, assignments: int, num_experts: int, x: torch.Tensor) -> bool:
    """Whether a call with this many assignments dequantizes its experts first (`DEQUANTIZE_ASSIGNMENTS`;
    never in a CUDA graph's capture, whose pool would hold the dequantized experts for good)."""
    return (kind in DEQUANTIZE_ASSIGNMENTS and assignments >= DEQUANTIZE_ASSIGNMENTS[kind] * num_experts
            and not fp8_linear.capturing(x))


def path_for(kind: str, assignments: int, num_experts: int, x: torch.Tensor, block: tuple[int, int] | None,
             dequantize_first: bool | None = None, w8a8: bool | None = None) -> str:
    """Which of `PATHS` a call on a stack of `kind` (FP8 ones in `block`) takes, `fused_experts`'
    overrides applied: a stack of tensors as read; a quantized one as read below
    `DEQUANTIZE_ASSIGNMENTS`, from it dequantized first, or FP8 W8A8 where `fp8_w8a8.supported`."""
    if dequantize_first is None or kind == "dense":  # a stack of tensors has nothing to dequantize
        dequantize_first = dequantizes(kind, assignments, num_experts, x)
    if w8a8 is None:
        w8a8 = dequantize_first and kind == "fp8" and fp8_w8a8.supported(x.device, block)
    return "w8a8" if w8a8 else "dequantized" if dequantize_first else "as read"


def _launches(w: ExpertStack, operands: tuple, kind: str, dtype: torch.dtype,
              dequantize_first: bool, launch: Callable[[tuple, int, int, str], None]) -> None:
    """Run `launch(operands, first expert, experts, format)` over the whole stack as stored (its
    `operands`, of format `kind`), or chunk by chunk dequantized to `dtype` (each chunk freed before
    the next is made)."""
    if not dequantize_first:
        launch(operands, 0, w.shape[0], kind)
        return
    for first, count in expert_dequantize.expert_chunks(w, dtype):
        launch(_operands(expert_dequantize.dequantize_experts(w, first, count, dtype)), first, count, "dense")


def fused_experts(x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, weights: torch.Tensor, experts: torch.Tensor,
                  block_m: int | None = None, act: GatedAct = SILU, b13: torch.Tensor | None = None,
                  dequantize_first: bool | None = None, w8a8: bool | None = None,
                  b2: torch.Tensor | None = None) -> torch.Tensor:
    """What `moe.experts_reference` computes, for x [T, hidden], w13 [E, 2 * width, hidden],
    w2 [E, hidden, width] (tensors, or both MXFP4, FP8 or packed integers), weights (float32) and experts
    [T, k], `act`, the gate and up biases `b13` [E, 2 * width] and the down biases `b2`
    [E, hidden]; block_m: the tile rows (by default `block_m_for`); `dequantize_first`: quantized
    experts take prefills' path (None: as
    `dequantizes` says): dequantized, a chunk at a time, for the kernels to read as tensors, or
    FP8 ones W8A8 where `w8a8` (None: where `fp8_w8a8.supported` on the device): x and the gated
    activations quantized per token and 128 columns (`fp8_w8a8.quantize`), the tensor cores
    multiplying codes by codes. `w8a8` True runs FP8 experts so whatever the call's size."""
    tokens, hidden = x.shape
    num_experts, width = w13.shape[0], w2.shape[2]
    top_k = experts.shape[1]
    count = tokens * top_k
    if count == 0:
        return torch.zeros_like(x)
    kind = _format(w13)
    up_operands, down_operands = _checked_operands(x, w13, w2, b13, b2)
    path = path_for(kind, count, num_experts, x, w13.block if kind == "fp8" else None, dequantize_first, w8a8)
    w8a8, dequantize_first = path == "w8a8", path == "dequantized"
    if w8a8 and (kind != "fp8" or w13.block[1] % fp8_w8a8.GROUP or w2.block[1] % fp8_w8a8.GROUP):
        raise ValueError(f"W8A8 experts are FP8 ones in blocks of whole {fp8_w8a8.GROUP}-column groups")
    block_m = block_m or block_m_for(count, num_experts, tensors=kind == "dense" or dequantize_first or w8a8)
    sorted_ids, block_expert = align(experts, num_experts, block_m)
    tiles, precision = block_expert.numel(), "ieee" if x.dtype == torch.float32 else "tf32"
    row_step, up_offset = (2, 1) if act.interleaved else (1, width)
    gated = torch.empty((count, width), dtype=x.dtype, device=x.device)
    a, a_scales = fp8_w8a8.quantize(x) if w8a8 else (x, x)

    def gate_up(operands: tuple, first: int, experts: int, fmt: str) -> None:
        w, scales, zeros, *strides = operands
        block_n, _, block_k, warps = launch_config(block_m, "w8a8" if w8a8 else fmt)
        rows = w13.block[0] if w8a8 else 1  # W8A8 scales one a tile: gate's and up's tiles each in one block of rows
        tile_scales = w8a8 and rows % block_n == 0 and row_step == 1 and up_offset % rows == 0
        gate_up_kernel[(tiles, triton.cdiv(width, block_n))](
            a, w, scales, zeros, w if b13 is None else b13, gated, sorted_ids, block_expert, count, top_k,
            hidden, width, a.stride(0), *strides, 0 if b13 is None else b13.stride(0), row_step, up_offset,
            act.alpha or 0.0, act.limit or 0.0, gated.stride(0), first, experts, a_scales, tokens, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, BIAS=b13 is not None, OSS=act.alpha is not None,
            CLAMP=act.limit is not None, PACKED=fmt == "mxfp4", FP8=fmt == "fp8" and not w8a8, W8A8=w8a8,
            TILE_SCALES=tile_scales, EVEN_K=w8a8 and hidden % block_k == 0, **_int_constants(w13, fmt, block_k),
            num_warps=warps)

    _launches(w13, up_operands, kind, x.dtype, dequantize_first, gate_up)
    out = torch.empty((count, hidden), dtype=x.dtype, device=x.device)
    routing_weights = weights.float().contiguous()
    act_in, act_scales = fp8_w8a8.quantize(gated) if w8a8 else (gated, gated)

    def down(operands: tuple, first: int, experts: int, fmt: str) -> None:
        w, scales, zeros, *strides = operands
        _, block_n, block_k, warps = launch_config(block_m, "w8a8" if w8a8 else fmt)
        tile_scales = w8a8 and w2.block[0] % block_n == 0
        down_kernel[(tiles, triton.cdiv(hidden, block_n))](
            act_in, w, scales, zeros, w if b2 is None else b2, out, routing_weights, sorted_ids, block_expert, count,
            width, hidden, act_in.stride(0), *strides, 0 if b2 is None else b2.stride(0), out.stride(0), first,
            experts, act_scales, count, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
            BIAS=b2 is not None, PACKED=fmt == "mxfp4", FP8=fmt == "fp8" and not w8a8, W8A8=w8a8,
            TILE_SCALES=tile_scales, EVEN_K=w8a8 and width % block_k == 0, **_int_constants(w2, fmt, block_k),
            num_warps=warps)

    _launches(w2, down_operands, kind, x.dtype, dequantize_first, down)
    return out.view(tokens, top_k, hidden).sum(dim=1)
