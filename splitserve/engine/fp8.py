"""FP8 checkpoints (`quant_method: fp8`, as Qwen3's and DeepSeek's FP8 releases store them): a
linear layer's `<name>.weight` in float8 e4m3 beside `<name>.weight_scale_inv` float32, one scale
per block of `weight_block_size` [rows, cols] (the last blocks of a dim partial), or one for the
whole tensor without a block size (AutoFP8's checkpoints name it `weight_scale`, beside the
`input_scale` of their static activation scheme). compressed-tensors' FP8 checkpoints
(llm-compressor's) name theirs `weight_scale`: one a tensor, one a row ([rows, 1]) or one a block.
Each value is its code times its block's (row's, tensor's) scale.
Activations stay in the serving dtype. Where the blocks allow, a sparse layer's experts stay FP8
(`Stacked`; the fused MoE kernels read the codes) and so, on a GPU whose Triton reads e4m3, do the
dense projections (`model.linear`; the W8A16 GEMM `model.fp8_linear`); other weights are
dequantized at load to the serving dtype."""
from __future__ import annotations

import math

import torch

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # of a weight's name: its scales
KERNEL_K = 32  # the Triton GEMMs' (least) k tile, which must lie within one block of columns
CODES_CAPABILITY = (8, 9)  # Triton reads float8 e4m3 on Ada and Hopper GPUs on; an A100's experts are dequantized
ROWS = (1, 1 << 30)  # a kept projection's block where each row has one scale (or the tensor one): all its columns
DUMMY_SCALE = 2.0 ** -8  # dummy weights' scale: normal(0, 0.02) values are codes of about 5, well within e4m3
# a static activation scheme's scales, and a KV-cache scheme's: activations and the cache are not quantized here
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] of `dtype` from float8 codes [rows, cols] and float32 scales
    [ceil(rows / block rows), ceil(cols / block cols)] (without a block, one scale or one a row,
    [rows, 1])."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn [rows, cols], got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    if block is None:
        if scale.numel() == 1:
            return (weight.float() * scale.float().reshape(())).to(dtype)
        if tuple(scale.shape) != (rows, 1):
            raise ValueError(f"FP8 scales for a {rows}x{cols} weight without blocks must be one value or one a "
                             f"row ({rows}x1), got shape {tuple(scale.shape)}")
        return (weight.float() * scale.float()).to(dtype)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(f"FP8 scales for a {rows}x{cols} weight in {block[0]}x{block[1]} blocks must be "
                         f"{grid[0]}x{grid[1]}, got {tuple(scale.shape)}")
    row_blocks = torch.arange(rows, device=scale.device) // block[0]
    col_blocks = torch.arange(cols, device=scale.device) // block[1]
    return (weight.float() * scale.float()[row_blocks][:, col_blocks]).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 scales) of `weight` [..., rows, cols] as FP8 checkpoints are made, what
    `dequantize` reads: each block's largest magnitude (without a block, the tensor's) maps to
    e4m3's largest value."""
    top, weight = torch.finfo(torch.float8_e4m3fn).max, weight.float()
    if block is None:
        scale = weight.abs().max().clamp_min(1e-12).reshape(1) / top
        return (weight / scale).to(torch.float8_e4m3fn), scale
    *lead, rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = weight.new_zeros(*lead, grid[0] * block[0], grid[1] * block[1])
    padded[..., :rows, :cols] = weight
    tiles = padded.view(*lead, grid[0], block[0], grid[1], block[1])
    scale = tiles.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / top
    codes = (tiles / scale[..., :, None, :, None]).view_as(padded)[..., :rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale


def build_capability() -> tuple[int, int] | None:
    """The compute capability of the CUDA device a model is being built on (torch's default
    device); None off CUDA."""
    device = torch.get_default_device()
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def codes_readable(capability: tuple[int, int] | None) -> bool:
    """Whether experts may stay FP8 on a CUDA device of this capability (None: no CUDA device, the
    CPU path, which dequantizes each expert as it runs)."""
    return capability is None or capability >= CODES_CAPABILITY


def projections_kept(capability: tuple[int, int] | None) -> bool:
    """Whether dense projections stay FP8 on a device of this capability: on CUDA where Triton reads
    e4m3 (`fp8_linear`); the CPU path dequantizes them at load, its matmuls in the serving dtype."""
    return capability is not None and capability >= CODES_CAPABILITY


def experts_unit(block: tuple[int, int] | None) -> int | None:
    """What a rank's slice of the experts' width is whole multiples of for the experts to stay FP8
    (the gate's and up's scale rows, down's scale columns): any slice for scales of a row or a
    tensor (None: kept one a row, `ROWS`); None where they cannot: blocks whose columns the
    kernels' k tiles would straddle."""
    if block is None:
        return 1
    return None if block[1] % KERNEL_K else math.lcm(*block)


class Stacked:
    """Stacked FP8 expert weights [experts, rows, cols] (float8 e4m3) and their block scales
    [experts, ceil(rows / block rows), ceil(cols / block cols)]. Indexing one expert gives its
    rows dequantized to `dtype` (what the CPU path multiplies by)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
        self.weight, self.scale, self.block, self.dtype = weight, scale, block, dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize(self.weight[expert], self.scale[expert], self.block, self.dtype)
