"""AutoAWQ's GEMM checkpoints (`quant_method: awq`, `version: gemm`: the AWQ releases of Qwen, Llama,
Mistral and others), read as compressed-tensors' pack-quantized ones (`int_weights`), so that they
load, shard and run as those do (kept packed on a GPU, dequantized on the CPU path). A quantized
linear layer [out, in] stores `qweight` int32 [in, out / 8] (each word eight 4-bit values of a row
of W.T, interleaved: the value of column c of the word's eight in nibble `ORDER[c]`), `qzeros`
int32 [groups, out / 8] packed the same way (absent without zero points), and `scales` [groups,
out] in the model's dtype; a weight is (value - zero point) x its group's scale, values and zero
points unsigned, or (value - 8) x scale without zero points. `AwqHandle` shows a safetensors file's
tensors under the pack-quantized names, each converted as it is read: values and zero points less
8 (pack-quantized's signed convention: their differences are unchanged), rows packed along W's
rows and zero points down them, scales float32 [out, groups], and `weight_shape` [out, in]."""
from __future__ import annotations

import torch

from splitserve.engine.int_weights import pack

BITS = 4  # AutoAWQ's GEMM kernels pack 4-bit values only
ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of a word holding each of its eight columns
SUFFIXES = {".qweight": ".weight_packed", ".qzeros": ".weight_zero_point", ".scales": ".weight_scale"}
SHAPE = ".weight_shape"  # synthesized from qweight's shape


def columns(words: torch.Tensor) -> torch.Tensor:
    """The unsigned values [rows, 8 x words] of AutoAWQ's words [rows, words], in column order."""
    shifts = torch.tensor(ORDER, dtype=torch.int32, device=words.device) * BITS
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 15).reshape(words.shape[0], -1)


def converted(suffix: str, tensor: torch.Tensor) -> torch.Tensor:
    """A layer's AutoAWQ tensor (`suffix`: one of SUFFIXES) as the pack-quantized part it stands for."""
    if suffix == ".scales":
        return tensor.t().float().contiguous()
    if tensor.dtype != torch.int32 or tensor.dim() != 2:
        raise ValueError(f"AutoAWQ's {suffix[1:]} must be int32 [rows, words], got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")
    signed = columns(tensor) - (1 << (BITS - 1))  # [in or groups, out]
    if suffix == ".qweight":
        return pack(signed.t(), BITS)  # [out, in / 8]
    return pack(signed, BITS).t().contiguous()  # zero points down W's rows: [out / 8, groups]


def names_of(name: str) -> list[str]:
    """The names a stored tensor reads as: an AutoAWQ tensor's pack-quantized part (qweight's, and
    its weight_shape), any other tensor's own."""
    for suffix, ours in SUFFIXES.items():
        if name.endswith(suffix):
            base = name.removesuffix(suffix)
            return [base + ours] + ([base + SHAPE] if suffix == ".qweight" else [])
    return [name]


class _Converted:
    """What the loader reads of a safetensors slice, of a converted tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


class AwqHandle:
    """A safetensors handle whose AutoAWQ tensors read as pack-quantized ones (module docstring);
    every other tensor as stored."""

    def __init__(self, handle):
        self.handle = handle
        self.sources = {ours: name for name in handle.keys() for ours in names_of(name) if ours != name}
        self._last: tuple[str, torch.Tensor] | None = None  # the latest conversion: the loader reads a name twice

    def keys(self) -> list[str]:
        return [ours for name in self.handle.keys() for ours in names_of(name)]

    def get_tensor(self, name: str) -> torch.Tensor:
        source = self.sources.get(name)
        if source is None:
            return self.handle.get_tensor(name)
        if name.endswith(SHAPE):
            rows, words = self.handle.get_slice(source).get_shape()
            return torch.tensor([words * 32 // BITS, rows])
        if self._last is None or self._last[0] != name:
            self._last = name, converted(source[source.rindex("."):], self.handle.get_tensor(source))
        return self._last[1]

    def get_slice(self, name: str):
        return self.handle.get_slice(name) if name not in self.sources else _Converted(self.get_tensor(name))
