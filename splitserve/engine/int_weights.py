"""Integer weights as compressed-tensors packs them (`format: pack-quantized`, llm-compressor's
W4A16 and W8A16 checkpoints): a linear layer's `<name>.weight_packed` int32 [rows, ceil(cols x
bits / 32)], each word holding 32 / bits consecutive values of a row, the first in its lowest bits,
each value stored as its signed integer plus 2^(bits-1); `<name>.weight_scale` [rows, groups] (a
group of `group_size` consecutive columns, or the whole row); `<name>.weight_shape` [rows, cols];
and, for an asymmetric scheme, `<name>.weight_zero_point` packed the same way down the rows
[ceil(rows x bits / 32), groups]. A weight is (value - zero point) x its group's scale.
Activations stay in the serving dtype; a weight the model does not keep packed (`model.linear.int_kept`:
the CPU path) is dequantized at load to it. On a GPU a sparse layer's experts stay packed (`Stacked`)
wherever every rank's slice of their width is whole words and groups (`model.moe`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
SUFFIXES = {"_packed": "packed", "_scale": "scale", "_shape": "shape", "_zero_point": "zero_point"}  # of `.weight`


@dataclass(frozen=True)
class IntWeights:
    bits: int  # 4 or 8
    group_size: int | None  # columns a scale covers; None: a row
    symmetric: bool  # no zero points (they are 0)

    def parts(self) -> frozenset[str]:
        """What a weight is stored as (SUFFIXES' values)."""
        return frozenset({"packed", "scale", "shape"} | (set() if self.symmetric else {"zero_point"}))


def part_of(name: str) -> tuple[str, str] | None:
    """(the weight's name, which part) for a tensor `<module>.weight<suffix>`; None for any other."""
    for suffix, part in SUFFIXES.items():
        if name.endswith(".weight" + suffix):
            return name.removesuffix(suffix), part
    return None


def unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The signed values [rows, count] packed along each row of `words` (int32 [rows, words])."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # an arithmetic shift: the mask drops the sign
    return fields.reshape(words.shape[0], -1)[:, :count] - (1 << (bits - 1))


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack`'s inverse: signed values [rows, cols] (each in [-2^(bits-1), 2^(bits-1))) as int32
    words [rows, ceil(cols x bits / 32)], each value plus 2^(bits-1), the first in the lowest bits."""
    per_word = 32 // bits
    rows, cols = values.shape
    fields = torch.zeros((rows, -(-cols // per_word) * per_word), dtype=torch.int64, device=values.device)
    fields[:, :cols] = values.to(torch.int64) + (1 << (bits - 1))
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * bits
    words = (fields.view(rows, -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize(parts: dict[str, torch.Tensor], scheme: IntWeights, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] of `dtype` from a weight's parts (`IntWeights.parts`); ValueError naming what
    does not fit the scheme."""
    shape = parts["shape"].tolist()
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"weight_shape must be [rows, cols], got {shape}")
    rows, cols = shape
    packed, scale = parts["packed"], parts["scale"]
    groups = 1 if scheme.group_size is None else -(-cols // scheme.group_size)
    expected = {"packed": (rows, -(-cols * scheme.bits // 32)), "scale": (rows, groups),
                "zero_point": (-(-rows * scheme.bits // 32), groups)}
    for part, tensor in parts.items():
        if part in expected and tuple(tensor.shape) != expected[part]:
            raise ValueError(f"weight_{part} of a {rows}x{cols} weight in {scheme.bits}-bit groups of "
                             f"{scheme.group_size or cols} must be {expected[part]}, got {tuple(tensor.shape)}")
    for part in ("packed", "zero_point"):
        if part in parts and parts[part].dtype != torch.int32:
            raise ValueError(f"weight_{part} must be int32, got {parts[part].dtype}")
    return weights(packed, scale, None if scheme.symmetric else parts["zero_point"], scheme, cols, dtype)


def weights(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: IntWeights, cols: int,
            dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] of `dtype`: (value - zero point) x scale from parts whose shapes fit the scheme
    (`zero` None: symmetric)."""
    values = unpack(packed, scheme.bits, cols).float()
    group = torch.arange(cols, device=packed.device) // (scheme.group_size or cols)  # each column's
    if zero is not None:
        values -= unpack(zero.t().contiguous(), scheme.bits, packed.shape[0]).t().float()[:, group]
    return (values * scale.float()[:, group]).to(dtype)


class Stacked:
    """Stacked packed-integer expert weights: words [experts, rows, ceil(cols x bits / 32)], scales
    [experts, rows, groups] and, asymmetric, zero points [experts, ceil(rows x bits / 32), groups].
    Indexing one expert gives its rows dequantized to `dtype` (what the CPU path multiplies by)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: IntWeights,
                 cols: int, dtype: torch.dtype):
        self.packed, self.scale, self.zero, self.scheme = packed, scale, zero, scheme
        self.cols, self.dtype = cols, dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.packed.shape[0], self.packed.shape[1], self.cols

    def __getitem__(self, expert: int) -> torch.Tensor:
        zero = None if self.zero is None else self.zero[expert]
        return weights(self.packed[expert], self.scale[expert], zero, self.scheme, self.cols, self.dtype)
