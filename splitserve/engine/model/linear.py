"""The decoder's dense projections: `MergedLinear`, several projections of one input as one matmul
(their weights stacked by rows: Q, K and V; gate and up), and `RowParallelLinear`, whose input
features are split over the tensor-parallel ranks (partial sums, all-reduced).

Each holds its weight in the serving dtype or, from an FP8 checkpoint where `fp8_block` allows,
as the checkpoint stores it: float8 e4m3 codes `weight` [out, in] and float32
`weight_scale_inv`, one per block or row (a merged projection's parts' scale rows stacked like
their rows), a byte a weight. On CUDA the W8A16 GEMM (`fp8_linear`) reads the codes; the CPU path
dequantizes them as it multiplies. A projection some LoRA adapter adapts adds its product
(`lora`, a `model.lora.LoraWeights`) to the output, before any all-reduce.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine import fp8
from splitserve.engine.config import ModelConfig
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


class Linear(nn.Linear):
    """x @ W.T (+ b), W in the serving dtype or, with `fp8_block`, the checkpoint's FP8 codes and
    block scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8_block: tuple[int, int] | None = None):
        kept = fp8_block is not None  # a weight in the serving dtype is never allocated
        super().__init__(in_features, out_features, bias=bias, device="meta" if kept else None)
        self.fp8_block = fp8_block
        self.lora = None  # model.lora.LoraWeights, set by attach_adapters
        if kept:
            rows, cols = fp8_block
            self.weight = frozen(out_features, in_features, dtype=torch.float8_e4m3fn)
            self.weight_scale_inv = frozen(-(-out_features // rows), -(-in_features // cols), dtype=torch.float32)
            self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._base(x, bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def _base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_block is None:
            return F.linear(x, self.weight, bias)
        if x.is_cuda:
            out = self.fused(x)
        else:
            out = F.linear(x, fp8.dequantize(self.weight, self.weight_scale_inv, self.fp8_block, x.dtype))
        return out if bias is None else out + bias

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 product through the Triton GEMM (CUDA, or Triton's interpreter)."""
        from splitserve.engine.model import fp8_linear  # triton: CUDA builds of torch bring it

        return fp8_linear.matmul(x, self.weight, self.weight_scale_inv, self.fp8_block)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul: the weight is theirs stacked by rows."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool,
                 slices: dict[str, ShardSlice] | None = None, fp8_block: tuple[int, int] | None = None):
        super().__init__(in_features, sum(parts.values()), bias, fp8_block)
        self.parts = parts  # the checkpoint's name of each projection -> its output rows, in order
        self.slices = slices or {}  # with tensor parallelism: the checkpoint rows each part holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.parts.values()), dim=-1)

    def part_rows(self, param: torch.Tensor) -> Iterable[tuple[str, int, int]]:
        """(part, first row, rows) of each part in `param`: the weight's or bias's rows, or the FP8
        scales' rows of blocks."""
        start = 0
        for part, rows in self.parts.items():
            rows = rows * param.shape[0] // self.out_features
            yield part, start, rows
            start += rows

    def shard_slices(self, prefix: str) -> Iterable[tuple[str, ShardSlice]]:
        for part, where in self.slices.items():
            yield f"{prefix}.{part}.weight", where
            if self.bias is not None:
                yield f"{prefix}.{part}.bias", where
            if self.fp8_block is not None:
                yield f"{prefix}.{part}.weight{fp8.SCALE_SUFFIXES[0]}", where.in_units(self.fp8_block[0])


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks: partial sums, all-reduced. The
    bias (whole on every rank) is rank 0's alone, added in its product, so the sum counts it once."""

    def __init__(self, in_features: int, out_features: int, shard_slice: ShardSlice | None, reduce: Reduce | None,
                 bias: bool = False, fp8_block: tuple[int, int] | None = None):
        super().__init__(in_features, out_features, bias, fp8_block)
        self.shard_slice, self.reduce = shard_slice, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x, self.bias if self.shard_slice is None or self.shard_slice.start == 0 else None)
        return out if self.reduce is None else self.reduce(out)

    def shard_slices(self, owner: str) -> Iterable[tuple[str, ShardSlice]]:
        if self.shard_slice is None:
            return
        yield f"{owner}.weight", self.shard_slice
        if self.fp8_block not in (None, fp8.ROWS):  # a row's scale is whole on every rank
            yield f"{owner}.weight{fp8.SCALE_SUFFIXES[0]}", self.shard_slice.in_units(self.fp8_block[1])
