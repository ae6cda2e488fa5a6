"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router scores every expert
for each token, the token goes through its top-k experts (each a gated SiLU MLP like Llama's) and
their outputs are summed, weighted by the router's softmax over those k (renormalized where the
model says so). Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate.

The experts' weights are two stacked tensors, `w13` [experts, 2 * width, hidden] (each expert's
gate rows, then its up rows) and `w2` [experts, hidden, width], so one kernel serves all experts
(`fused_moe` on CUDA). `checkpoint_tensors` names each expert's slices as the checkpoint stores
them. With tensor parallelism every rank holds every expert's slice [lo, hi) of the width
(column-parallel gate and up, row-parallel down), a slice of the shared expert likewise, and the
routers whole; the block all-reduces its partial sums once. `experts_reference` is the torch oracle and the CPU path.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.sharding import Shard, ShardSlice


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names a sparse layer's parts: `<block>.gate` is the router,
    `<block>.experts.<e>.<gate|up|down>.weight` expert e's projections."""

    block: str
    gate: str
    up: str
    down: str


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def expert_names(config: ModelConfig) -> ExpertNames:
    return MIXTRAL_NAMES if config.architecture == "MixtralForCausalLM" else QWEN_MOE_NAMES


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], experts int64 [T, k]): each token's top-k experts by the softmax of
    its router logits (computed in float32), their probabilities renormalized to sum to one or not."""
    weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Experts(nn.Module):
    def __init__(self, c: ModelConfig, names: ExpertNames, shard: Shard = Shard()):
        super().__init__()
        lo, hi = shard.split(c.moe_intermediate_size)
        self.names, self.width = names, hi - lo
        self.slice = ShardSlice(0, lo, hi, c.moe_intermediate_size) if shard.size > 1 else None
        self.w13 = nn.Parameter(torch.empty(c.num_experts, 2 * self.width, c.hidden_size))
        self.w2 = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, self.width))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from splitserve.engine.model import fused_moe  # triton: CUDA builds of torch bring it

            return fused_moe.fused_experts(x, self.w13, self.w2, weights, experts)
        return experts_reference(x, self.w13, self.w2, weights, experts)

    def checkpoint_tensors(self, owner: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, view) of each expert's projections held in parameter `kind`."""
        param = getattr(self, kind)
        for e in range(param.shape[0]):
            if kind == "w13":
                yield f"{owner}.{e}.{self.names.gate}.weight", param[e, :self.width]
                yield f"{owner}.{e}.{self.names.up}.weight", param[e, self.width:]
            else:
                yield f"{owner}.{e}.{self.names.down}.weight", param[e]

    def shard_slices(self, owner: str) -> Iterator[tuple[str, ShardSlice]]:
        if self.slice is None:
            return
        down = ShardSlice(1, self.slice.start, self.slice.stop, self.slice.total)
        for e in range(self.w13.shape[0]):
            yield f"{owner}.{e}.{self.names.gate}.weight", self.slice
            yield f"{owner}.{e}.{self.names.up}.weight", self.slice
            yield f"{owner}.{e}.{self.names.down}.weight", down


class SparseMoeBlock(nn.Module):
    def __init__(self, c: ModelConfig, names: ExpertNames, shard: Shard = Shard(),
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, shared_expert: nn.Module | None = None):
        """`shared_expert`: Qwen2-MoE's, an MLP whose output on this rank is a partial sum (not reduced)."""
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)  # the router
        self.experts = Experts(c, names, shard)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if shared_expert is not None else None
        self.top_k, self.renormalize, self.reduce = c.num_experts_per_tok, c.norm_topk_prob, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:  # the gate is per token, so it scales a partial sum exactly
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.reduce is None else self.reduce(out)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate(x)) * up(x)), one matmul per
    expert over the tokens routed to it; each expert's share is rounded to x's dtype as it is added."""
    out, width, top_k = torch.zeros_like(x), w2.shape[2], experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # assignment token * k + slot, grouped by expert
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=w13.shape[0]).tolist()):
        if not count:
            continue
        assignments = order[start:start + count]
        start += count
        tokens = assignments // top_k
        gate, up = F.linear(x[tokens], w13[e]).split(width, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights.flatten()[assignments, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out
