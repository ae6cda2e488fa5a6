"""FlashAttention-2's varlen forward as CUDA builds of torch ship it (`aten::_flash_attention_forward`,
the kernel under SDPA's flash backend and `torch.nn.attention.varlen`): causal attention of fresh
prompts over their own K and V, GQA and a sliding window included, with nothing to install or
compile. It runs fp16 and bf16 heads of up to 256 dims (a multiple of 8) on sm_80 to sm_90 GPUs
(A100, L40S, H100, H200) and has no soft cap (nor sinks, which the caller keeps from every
FlashAttention kernel): such prompts take the Triton kernel. It reads values, never FP8 codes.

The op is called directly, with only the arguments its schema has had since torch 2.5 (the
installed torch's is checked in CI): `varlen_attn`'s own signature changed between 2.11 and 2.13."""
from __future__ import annotations

import torch

from splitserve.engine.attention.base import Scoring

CAPABILITIES = ((8, 0), (10, 0))  # [from, to): the GPUs torch's FlashAttention-2 build runs on
MAX_HEAD_DIM = 256
_forward = torch.ops.aten._flash_attention_forward


def runs_on(device: torch.device) -> bool:
    """This torch was built with FlashAttention and `device` is a GPU it runs on."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return CAPABILITIES[0] <= torch.cuda.get_device_capability(device) < CAPABILITIES[1]


def takes(q: torch.Tensor, scoring: Scoring) -> bool:
    """Whether these queries' attention (fp16 or bf16, given no sinks) is one it computes."""
    dim = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= MAX_HEAD_DIM
            and scoring.softcap is None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scoring: Scoring,
           window: int | None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] (KVH divides H): prompts laid end to end, `cu` (int32 [n + 1])
    where each starts; each query attends to its prompt's positions up to its own (within the
    last `window`). Returns [T, H, D]."""
    left = -1 if window is None else window - 1  # keys at p - left .. p
    return _forward(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scoring.scale,
                    window_size_left=left, window_size_right=0)[0]
