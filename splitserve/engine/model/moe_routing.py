"""A sparse layer's routing on CUDA in one Triton launch: each token's softmax over its router
logits (float32), its top-k experts and their probabilities, renormalized to sum to one or not.
`moe.route`'s torch ops (the CPU path, and the oracle) are four launches or more a layer. On CPU
the kernel runs only under Triton's interpreter (how the tests check it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, num_experts, stride_logits, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per token: the top TOP_K of its softmax, most likely first (ties: the lower
    expert first), each picked by an argmax and then taken out of the running."""
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_logits + e, mask=e < num_experts, other=float("-inf"))
    shifted = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), 0))
    probs = shifted / tl.sum(shifted, 0)  # lanes past the experts hold 0, after every expert (top_k <= experts)
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    experts = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(probs, 0)
        weights = tl.where(slot == k, tl.max(probs, 0), weights)
        experts = tl.where(slot == k, best, experts)
        probs = tl.where(e == best, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)  # slots past TOP_K hold 0
    tl.store(weights_ptr + token * TOP_K + slot, weights, mask=slot < TOP_K)
    tl.store(experts_ptr + token * TOP_K + slot, experts.to(tl.int64), mask=slot < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one launch: (weights float32 [T, k], experts int64 [T, k]) of logits [T, E]."""
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts or logits.stride(1) != 1:
        raise ValueError(f"routing needs 0 < top_k <= {num_experts} experts and the experts' logits contiguous, "
                         f"got top_k {top_k}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    experts = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, experts, num_experts, logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                 BLOCK_K=triton.next_power_of_2(top_k))
    return weights, experts
