"""The decoder's dense projections: `MergedLinear`, several projections of one input as one matmul
(their weights stacked by rows: Q, K and V; gate and up), and `RowParallelLinear`, whose input
features are split over the tensor-parallel ranks (partial sums, all-reduced).

Each holds its weight in the serving dtype or, from an FP8 checkpoint where `fp8_block` allows,
as the checkpoint stores it: float8 e4m3 codes `weight` [out, in] and float32
`weight_scale_inv`, one per block or row (a merged projection's parts' scale rows stacked like
their rows), a byte a weight. On CUDA the W8A16 GEMM (`fp8_linear`) reads the codes; the CPU path
dequantizes them as it multiplies. From a packed integer checkpoint, where `int_kept` allows, it
holds the checkpoint's `weight_packed` words, `weight_scale` (float32) and `weight_zero_point`
(`int_weights`; a merged projection's parts' rows stacked), read by the W4A16 / W8A16 GEMM
(`int_linear`) on CUDA. A projection some LoRA adapter adapts adds its product (`lora`, a
`model.lora.LoraWeights`) to the output, before any all-reduce.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine import fp8, int_weights
from splitserve.engine.config import ModelConfig
from splitserve.engine.int_weights import IntWeights
from splitserve.engine.model.sharding import ShardSlice

Reduce = Callable[[torch.Tensor], torch.Tensor]  # all-reduce (sum) over the worker's ranks


def frozen(*shape: int, dtype: torch.dtype = torch.uint8) -> nn.Parameter:
    """A quantized format's codes or scales: a parameter in its own dtype, never trained."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def fp8_block(c: ModelConfig, modules: Iterable[str], rows: Iterable[int] = (),
              cols: Iterable[int] = ()) -> tuple[int, int] | None:
    """The block size a projection of the checkpoint's `modules` (a merged one's parts) keeps its
    FP8 codes in (`fp8.ROWS` for scales of a row or a tensor, kept one a row), or None where its
    weight takes the serving dtype: no FP8 checkpoint, a device whose Triton cannot read e4m3
    (`fp8.projections_kept`), a part stored unquantized, k tiles that would straddle a block's
    columns, or a cut inside a block: of the rows (`rows`: the parts' bounds, on this rank and in
    the checkpoint) or of the columns (`cols`)."""
    if c.quantization != "fp8" or not fp8.projections_kept(fp8.build_capability()):
        return None
    if any(c.stored_unquantized(m) for m in modules):
        return None
    block = c.weight_block_size or fp8.ROWS  # a row's scale spans its columns: no cut splits one
    cuts = [r % block[0] for r in rows] + ([k % block[1] for k in cols] if block != fp8.ROWS else [])
    return None if block[1] % fp8.KERNEL_K or any(cuts) else block


def int_kept(c: ModelConfig, modules: Iterable[str], rows: Iterable[int] = (),
             cols: Iterable[int] = ()) -> IntWeights | None:
    """The integer scheme a projection of the checkpoint's `modules` keeps its packed words in, or
    None where its weight takes the serving dtype (dequantized at load): no integer checkpoint, no
    CUDA device (the CPU path), a part stored unquantized, or a cut (as `fp8_block`'s) inside a word
    of zero points packed down the rows (`rows`), or inside a word or a group of the columns (`cols`)."""
    scheme = c.int_weights
    if c.quantization != "int" or fp8.build_capability() is None or any(c.stored_unquantized(m) for m in modules):
        return None
    per_word = 32 // scheme.bits
    column_unit = math.lcm(per_word, scheme.group_size or 1)
    cuts = [k % column_unit for k in cols] + ([] if scheme.symmetric else [r % per_word for r in rows])
    return None if any(cuts) else scheme


class Linear(nn.Linear):
    """x @ W.T (+ b), W in the serving dtype or, with `fp8_block`, the checkpoint's FP8 codes and
    block scales, or with `ints`, its packed integers."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8_block: tuple[int, int] | None = None,
                 ints: IntWeights | None = None):
        self.fp8_block, self.ints = fp8_block, ints
        super().__init__(in_features, out_features, bias=bias, device="meta" if self.kept else None)
        self.lora = None  # model.lora.LoraWeights, set by attach_adapters
        if fp8_block is not None:
            rows, cols = fp8_block
            self.weight = frozen(out_features, in_features, dtype=torch.float8_e4m3fn)
            self.weight_scale_inv = frozen(-(-out_features // rows), -(-in_features // cols), dtype=torch.float32)
        if ints is not None:
            self.register_parameter("weight", None)
            groups = -(-in_features // (ints.group_size or in_features))
            self.weight_packed = frozen(out_features, -(-in_features * ints.bits // 32), dtype=torch.int32)
            self.weight_scale = frozen(out_features, groups, dtype=torch.float32)
            self.weight_zero_point = None if ints.symmetric else frozen(-(-out_features * ints.bits // 32), groups,
                                                                        dtype=torch.int32)
        if self.kept:  # a weight in the serving dtype is never allocated
            self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def kept(self) -> bool:
        """Whether the weight stays in the checkpoint's format (FP8 codes, packed integers)."""
        return self.fp8_block is not None or self.ints is not None

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._base(x, bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def _base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.kept:
            return F.linear(x, self.weight, bias)
        out = self.fused(x) if x.is_cuda else F.linear(x, self.dequantized(x.dtype))
        return out if bias is None else out + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The kept weight in `dtype` (what the CPU path multiplies by)."""
        if self.fp8_block is not None:
            return fp8.dequantize(self.weight, self.weight_scale_inv, self.fp8_block, dtype)
        return int_weights.weights(self.weight_packed, self.weight_scale, self.weight_zero_point, self.ints,
                                   self.in_features, dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The kept weight's product through its Triton GEMM (CUDA, or Triton's interpreter)."""
        from splitserve.engine.model import fp8_linear, int_linear  # triton: CUDA builds of torch bring it

        if self.ints is not None:
            return int_linear.matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.ints)
        return fp8_linear.matmul(x, self.weight, self.weight_scale_inv, self.fp8_block)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul: the weight is theirs stacked by rows."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool,
                 slices: dict[str, ShardSlice] | None = None, fp8_block: tuple[int, int] | None = None,
                 ints: IntWeights | None = None):
        super().__init__(in_features, sum(parts.values()), bias, fp8_block, ints)
        self.parts = parts  # the checkpoint's name of each projection -> its output rows, in order
        self.slices = slices or {}  # with tensor parallelism: the checkpoint rows each part holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.parts.values()), dim=-1)

    def part_rows(self, param: torch.Tensor) -> Iterable[tuple[str, int, int]]:
        """(part, first row, rows) of each part in `param`: the weight's or bias's rows, the FP8
        scales' rows of blocks, or the packed zero points' rows of words."""
        start = 0
        for part, rows in self.parts.items():
            rows = rows * param.shape[0] // self.out_features
            yield part, start, rows
            start += rows

    def shard_slices(self, prefix: str) -> Iterable[tuple[str, ShardSlice]]:
        for part, where in self.slices.items():
            if self.bias is not None:
                yield f"{prefix}.{part}.bias", where
            if self.ints is not None:
                yield f"{prefix}.{part}.weight_packed", where
                yield f"{prefix}.{part}.weight_scale", where
                if self.weight_zero_point is not None:
                    yield f"{prefix}.{part}.weight_zero_point", where.in_units(32 // self.ints.bits)
                continue
            yield f"{prefix}.{part}.weight", where
            if self.fp8_block is not None:
                yield f"{prefix}.{part}.weight{fp8.SCALE_SUFFIXES[0]}", where.in_units(self.fp8_block[0])


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks: partial sums, all-reduced. The
    bias (whole on every rank) is rank 0's alone, added in its product, so the sum counts it once."""

    def __init__(self, in_features: int, out_features: int, shard_slice: ShardSlice | None, reduce: Reduce | None,
                 bias: bool = False, fp8_block: tuple[int, int] | None = None, ints: IntWeights | None = None):
        super().__init__(in_features, out_features, bias, fp8_block, ints)
        self.shard_slice, self.reduce = shard_slice, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x, self.bias if self.shard_slice is None or self.shard_slice.start == 0 else None)
        return out if self.reduce is None else self.reduce(out)

    def shard_slices(self, owner: str) -> Iterable[tuple[str, ShardSlice]]:
        if self.shard_slice is None:
            return
        if self.ints is not None:  # words of a row's values; a row's one scale (no groups) whole on every rank
            yield f"{owner}.weight_packed", self.shard_slice.in_units(32 // self.ints.bits)
            if self.ints.group_size is not None:
                yield f"{owner}.weight_scale", self.shard_slice.in_units(self.ints.group_size)
                if self.weight_zero_point is not None:
                    yield f"{owner}.weight_zero_point", self.shard_slice.in_units(self.ints.group_size)
            return
        yield f"{owner}.weight", self.shard_slice
        if self.fp8_block not in (None, fp8.ROWS):  # a row's scale is whole on every rank
            yield f"{owner}.weight{fp8.SCALE_SUFFIXES[0]}", self.shard_slice.in_units(self.fp8_block[1])
