"""Where the decoder's Triton kernels outside attention and the projections run (the norms, the
rotary embedding, the gated activation in `triton_ops`; a sparse layer's routing in
`moe_routing` and its experts in `fused_moe`; a captured step's LoRA adapters in `triton_lora`):
on CUDA tensors, a launch each, where the torch
code (the CPU path, and the kernels' oracle) takes several ops. One rule for all of them, so a
test can turn it on for CPU tensors and run the kernels under Triton's interpreter through the
model's own code."""
from __future__ import annotations

import torch


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether the elementwise work on `x` runs as Triton kernels: on CUDA."""
    return x.is_cuda


def ops():
    """`triton_ops`, imported on first use: CUDA builds of torch bring triton; CPU installs may not."""
    from splitserve.engine.model import triton_ops

    return triton_ops


def lora_ops():
    """`triton_lora` (LoRA adapters by row), imported on first use."""
    from splitserve.engine.model import triton_lora

    return triton_lora
