"""MXFP4 (the OCP microscaling format GPT-OSS's checkpoints store their experts in): a tensor
`<name>` is stored as `<name>_blocks` uint8 [..., groups, 16], two 4-bit E2M1 codes a byte (the low
nibble first), and `<name>_scales` uint8 [..., groups], each group's 32 values' power of two biased
by 127. Rows are the projection's outputs, as a Linear's weight holds them. The experts keep them
so (`Packed`; the fused MoE kernels read the bytes) or dequantize them at load (`dequantize`)."""
from __future__ import annotations

import torch

from splitserve.engine.quantization_config import MXFP4_GROUP

SUFFIXES = ("_blocks", "_scales")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
GROUP = MXFP4_GROUP  # values a scale covers
DUMMY_SCALE = SCALE_BIAS - 7  # uniformly random codes (rms 2.93) then have an rms of 0.023, near dummy_weights.DUMMY_STD


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., groups * 32] of `dtype` (every value exact in bfloat16 and wider), one index of the
    first dim (an expert) at a time so the codes' temporary stays small."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., rows, groups, 16] and scales uint8 [..., rows, groups], "
                         f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    shape, groups, chunks = scales.shape, scales.shape[-1], blocks.shape[0] if blocks.dim() > 3 else 1
    blocks, scales = blocks.reshape(chunks, -1, groups, 16), scales.reshape(chunks, -1, groups)
    out = torch.empty((*scales.shape, GROUP), dtype=dtype, device=blocks.device)  # [chunks, rows, groups, 32]
    for i in range(chunks):
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).flatten(-2)  # [rows, groups, 32]
        exponent = (scales[i].to(torch.int32) - SCALE_BIAS)[..., None]
        torch.ldexp(table[codes.long()], exponent.to(dtype), out=out[i])
    return out.reshape(*shape[:-1], groups * GROUP)


class Packed:
    """Stacked MXFP4 weights of logical shape [experts, rows, groups * 32] as the checkpoint stores
    them: `blocks` [experts, rows, groups, 16], `scales` [experts, rows, groups]. Indexing one expert
    gives its rows dequantized to `dtype` (what the CPU path multiplies by)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.blocks, self.scales, self.dtype = blocks, scales, dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups = self.scales.shape
        return experts, rows, groups * GROUP

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize(self.blocks[expert], self.scales[expert], self.dtype)
