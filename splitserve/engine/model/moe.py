"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5, Ernie 4.5,
MiniMax-M2): a router scores every expert for each token, the token goes through its top-k experts
(each a gated MLP like Llama's) and their outputs are summed, weighted by the router's softmax over
those k (renormalized where the model says so; GLM-4.5's, Ernie 4.5's and MiniMax-M2's chosen by a
biased score, `route_biased`). Qwen2-MoE adds a shared expert every token takes, scaled by a
sigmoid gate (GLM-4.5's and Ernie 4.5's are ungated). GPT-OSS's router and experts have biases and
its experts a clamped SwiGLU (`GatedAct`).

The experts' weights are two stacked tensors, `w13` [experts, 2 * width, hidden] (each expert's
gate rows, then its up rows; GPT-OSS's alternate gate, up, as its checkpoints store them) and `w2`
[experts, hidden, width], so one kernel serves all experts (`fused_moe` on CUDA). An MXFP4
checkpoint's experts (GPT-OSS's release) stay packed as it stores them, rows alike (`mxfp4.Packed`:
`w13_blocks`, `w13_scales`, `w2_blocks`, `w2_scales`), 4.25 bits a weight; an FP8 checkpoint's
stay FP8 (`fp8.Stacked`: `w13`, `w2` float8 and `w13_scale`, `w2_scale`, one a block, or one a row
for scales of a row or a tensor: `fp8.ROWS`); on a GPU a packed integer checkpoint's (W4A16 / W8A16,
`int_weights`) stay its int32 words (`int_weights.Stacked`: `w13_packed`, `w13_scale`, `w13_zero_point`
where asymmetric, and w2's), a quarter of bf16's bytes at 4 bits. With tensor parallelism each
rank's slice of the width is then whole units (32-value groups; FP8's blocks; any, for scales of a
row, down's then whole on every rank; whole words and groups of integers)
(`Shard.split_in`: ranks' widths may differ by a unit, as partial sums they add up alike);
a width of fewer units than ranks, or of a part of one, is dequantized at load instead.
`checkpoint_tensors` names each expert's slices as the checkpoint stores them (GPT-OSS's stacked,
[experts, in, out]). With tensor parallelism every rank holds every expert's slice [lo, hi) of the
width (column-parallel gate and up, row-parallel down), a slice of the shared expert likewise, and
the routers whole; the block all-reduces its partial sums once, then adds the down biases.
`experts_reference` is the torch oracle and the CPU path.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine import fp8, int_weights, mxfp4
from splitserve.engine.config import ModelConfig
from splitserve.engine.model import triton_dispatch
from splitserve.engine.model.linear import frozen
from splitserve.engine.model.sharding import Shard, ShardSlice

ExpertStack = torch.Tensor | mxfp4.Packed | fp8.Stacked | int_weights.Stacked  # [experts, rows, cols], as stored


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names a sparse layer's parts: `<block>.<router>` is the router,
    `<block>.experts.<e>.<gate|up|down>.weight` expert e's projections; `stacked` ones (GPT-OSS)
    are `<block>.experts.<gate|down>` [experts, in, out] for all experts, with `_bias` beside them;
    `<block>.<shared>` the shared experts' MLP, where the model has one; `<block>.<choice_bias>`
    holds a biased choice's `e_score_correction_bias` (GLM-4.5's the router, [experts]; Ernie
    4.5's a module of its own, [1, experts]; MiniMax-M2's, "", the block itself, [experts])."""

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate"
    stacked: bool = False
    shared: str = "shared_expert"
    choice_bias: str = "gate"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
GPT_OSS_NAMES = ExpertNames("mlp", "gate_up_proj", "", "down_proj", router="router", stacked=True)
GLM4_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts")
ERNIE45_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts",
                                choice_bias="moe_statics")
MINIMAX_M2_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2", choice_bias="")


def expert_names(config: ModelConfig) -> ExpertNames:
    return {"MixtralForCausalLM": MIXTRAL_NAMES, "GptOssForCausalLM": GPT_OSS_NAMES,
            "Glm4MoeForCausalLM": GLM4_MOE_NAMES, "Ernie4_5_MoeForCausalLM": ERNIE45_MOE_NAMES,
            "MiniMaxM2ForCausalLM": MINIMAX_M2_NAMES}.get(config.architecture, QWEN_MOE_NAMES)


@dataclass(frozen=True)
class GatedAct:
    """Where an expert's gate and up rows sit in w13 and how they combine: by default all gate rows
    then all up rows, silu(gate) * up; `interleaved` (GPT-OSS) alternates them, and with `alpha`
    the output is (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= `limit` and up to
    [-limit, limit] first (where a limit is given)."""

    interleaved: bool = False
    alpha: float | None = None
    limit: float | None = None

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) of gate-and-up outputs [..., 2 * width]."""
        if self.interleaved:
            return h[..., 0::2], h[..., 1::2]
        return h.chunk(2, dim=-1)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.alpha is None:
            return F.silu(gate) * up
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)


SILU = GatedAct()


def gated_act(config: ModelConfig) -> GatedAct:
    if config.architecture == "GptOssForCausalLM":
        return GatedAct(True, config.swiglu_alpha, config.swiglu_limit)
    return SILU


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], experts int64 [T, k]): each token's top-k experts by the softmax of
    its router logits (computed in float32), their probabilities renormalized to sum to one or not.
    Where the elementwise work runs as Triton kernels (`triton_dispatch`), one launch (`moe_routing`)."""
    if triton_dispatch.runs_kernels(logits):
        from splitserve.engine.model import moe_routing  # triton: CUDA builds of torch bring it

        return moe_routing.route(logits, top_k, renormalize)
    weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_biased(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: tuple[int, int], renormalize: bool,
                 scale: float, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (DeepSeek-V3's, `score` "sigmoid") and Ernie 4.5's ("softmax") routing from float32
    logits [T, experts]: each token's top-k experts by score(logits) + `bias` among its `groups[1]`
    best of `groups[0]` groups of experts (a group scores the sum of its two best), weighted by
    their score alone, renormalized or not, times `scale`. Torch ops on every device, with no host
    sync."""
    scores = logits.sigmoid() if score == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias
    count, best = groups
    if count > 1:
        grouped = choice.view(choice.shape[0], count, -1)
        kept = grouped.topk(2, dim=-1).values.sum(-1).topk(best, dim=-1).indices
        mask = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(1)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class Experts(nn.Module):
    def __init__(self, c: ModelConfig, names: ExpertNames, shard: Shard = Shard()):
        super().__init__()
        # FP8's scales: one a block, or one a row (a tensor's repeated)
        total, self.block, unit = c.moe_intermediate_size, c.weight_block_size or fp8.ROWS, _kept_unit(c, names)
        # the checkpoint's format, kept where every rank's slice is whole units; None: the model's dtype
        self.format = c.quantization if unit and total % unit == 0 and total // unit >= shard.size else None
        lo, hi = shard.split_in(total, unit) if self.format else shard.split(total)
        self.names, self.width, self.act, self.ints = names, hi - lo, gated_act(c), c.int_weights
        self.slice = ShardSlice(0, lo, hi, total) if shard.size > 1 else None
        experts, hidden = c.num_experts, c.hidden_size
        self.num_experts = experts
        if self.format == "mxfp4":
            for name, rows, cols in (("w13", 2 * self.width, hidden), ("w2", hidden, self.width)):
                self.register_parameter(f"{name}_blocks", frozen(experts, rows, cols // mxfp4.GROUP, 16))
                self.register_parameter(f"{name}_scales", frozen(experts, rows, cols // mxfp4.GROUP))
        elif self.format == "int":
            self._packed_parameters(experts, hidden)
        elif self.format == "fp8":
            (block_rows, block_cols), code = self.block, torch.float8_e4m3fn
            self.w13 = frozen(experts, 2 * self.width, hidden, dtype=code)
            self.w13_scale = frozen(experts, 2 * self.width // block_rows, -(-hidden // block_cols),
                                     dtype=torch.float32)
            self.w2 = frozen(experts, hidden, self.width, dtype=code)
            self.w2_scale = frozen(experts, -(-hidden // block_rows), -(-self.width // block_cols),
                                   dtype=torch.float32)
        else:
            self.w13 = nn.Parameter(torch.empty(c.num_experts, 2 * self.width, c.hidden_size))
            self.w2 = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, self.width))
        biased = names.stacked  # GPT-OSS
        self.b13 = nn.Parameter(torch.empty(c.num_experts, 2 * self.width)) if biased else None
        self.b2 = nn.Parameter(torch.empty(c.num_experts, c.hidden_size)) if biased else None
        self.adds_b2 = shard.rank == 0  # the ranks' partial sums are reduced: the down biases counted once

    def _packed_parameters(self, experts: int, hidden: int) -> None:
        """w13's and w2's int32 words, float32 scales and (asymmetric) zero points packed down the rows."""
        ints = self.ints
        for name, rows, cols in (("w13", 2 * self.width, hidden), ("w2", hidden, self.width)):
            groups = -(-cols // (ints.group_size or cols))
            self.register_parameter(f"{name}_packed", frozen(experts, rows, -(-cols * ints.bits // 32),
                                                             dtype=torch.int32))
            self.register_parameter(f"{name}_scale", frozen(experts, rows, groups, dtype=torch.float32))
            zeros = None if ints.symmetric else frozen(experts, -(-rows * ints.bits // 32), groups, dtype=torch.int32)
            self.register_parameter(f"{name}_zero_point", zeros)

    def stacks(self, dtype: torch.dtype) -> tuple:
        """(w13, w2): the parameters, or their MXFP4 bytes, FP8 codes or packed integers, which
        dequantize to `dtype`."""
        if self.format == "int":
            hidden = self.w2_packed.shape[1]
            return (int_weights.Stacked(self.w13_packed, self.w13_scale, self.w13_zero_point, self.ints, hidden, dtype),
                    int_weights.Stacked(self.w2_packed, self.w2_scale, self.w2_zero_point, self.ints, self.width,
                                        dtype))
        if self.format == "mxfp4":
            return (mxfp4.Packed(self.w13_blocks, self.w13_scales, dtype),
                    mxfp4.Packed(self.w2_blocks, self.w2_scales, dtype))
        if self.format == "fp8":
            return (fp8.Stacked(self.w13, self.w13_scale, self.block, dtype),
                    fp8.Stacked(self.w2, self.w2_scale, self.block, dtype))
        return self.w13, self.w2

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's sum over each token's experts (on CUDA, `fused`); rank 0's has the down biases."""
        if triton_dispatch.runs_kernels(x):
            return self.fused(x, weights, experts)
        return experts_reference(x, *self.stacks(x.dtype), weights, experts, self.act, self.b13, self.down_biases)

    @property
    def down_biases(self) -> torch.Tensor | None:
        return self.b2 if self.adds_b2 else None

    def fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, block_m: int | None = None,
              dequantize_first: bool | None = None) -> torch.Tensor:
        """The same through the Triton kernels (`fused_moe`: CUDA, or Triton's interpreter)."""
        from splitserve.engine.model import fused_moe  # triton: CUDA builds of torch bring it

        return fused_moe.fused_experts(x, *self.stacks(x.dtype), weights, experts, block_m, self.act, self.b13,
                                       dequantize_first, b2=self.down_biases)

    def checkpoint_tensors(self, owner: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, view) of each expert's projections held in parameter `kind`."""
        param = getattr(self, kind)
        if self.names.stacked:
            stack, _, half = kind.partition("_")  # half: MXFP4's blocks or scales, as the checkpoint holds them
            name = self.names.gate if stack in ("w13", "b13") else self.names.down
            if half or stack.startswith("b"):
                yield f"{owner}.{name}_{half or 'bias'}", param
            else:
                yield f"{owner}.{name}", param.transpose(1, 2)
            return
        if self.format == "int":  # w13_packed: `.weight_packed`, and so on
            suffix = ".weight_" + kind.partition("_")[2]
        else:
            suffix = ".weight" + (fp8.SCALE_SUFFIXES[0] if kind.endswith("_scale") else "")  # FP8's block scales
        for e in range(param.shape[0]):
            if kind.startswith("w13"):  # gate rows (or their scales' rows, their zero points' words), then up's
                half = param.shape[1] // 2
                yield f"{owner}.{e}.{self.names.gate}{suffix}", param[e, :half]
                yield f"{owner}.{e}.{self.names.up}{suffix}", param[e, half:]
            else:
                yield f"{owner}.{e}.{self.names.down}{suffix}", param[e]

    def shard_slices(self, owner: str) -> Iterator[tuple[str, ShardSlice]]:
        if self.slice is None:
            return
        if self.names.stacked:  # [experts, in, out]; gate and up alternate, so a rank's pairs are one range
            lo, hi, total = self.slice.start, self.slice.stop, self.slice.total
            gate, down = f"{owner}.{self.names.gate}", f"{owner}.{self.names.down}"
            yield f"{gate}_bias", ShardSlice(1, 2 * lo, 2 * hi, 2 * total)
            if self.format != "mxfp4":
                yield gate, ShardSlice(2, 2 * lo, 2 * hi, 2 * total)
                yield down, ShardSlice(1, lo, hi, total)
                return
            groups = [n // mxfp4.GROUP for n in (lo, hi, total)]  # packed rows are outputs: down's width is in groups
            for half in mxfp4.SUFFIXES:
                yield gate + half, ShardSlice(1, 2 * lo, 2 * hi, 2 * total)
                yield down + half, ShardSlice(2, *groups)
            return
        lo, hi, total = self.slice.start, self.slice.stop, self.slice.total
        parts = {".weight": (self.slice, ShardSlice(1, lo, hi, total))}  # (gate and up, down)
        if self.format == "int":
            parts = self._packed_slices()
        elif self.format == "fp8":  # their scales': rows of blocks, and down's columns of them (a row's: whole)
            rows, cols = self.block
            parts[".weight" + fp8.SCALE_SUFFIXES[0]] = (
                ShardSlice(0, lo // rows, hi // rows, total // rows),
                None if self.block == fp8.ROWS else ShardSlice(1, lo // cols, hi // cols, total // cols))
        for e in range(self.num_experts):
            for suffix, (gate_up, down) in parts.items():
                yield f"{owner}.{e}.{self.names.gate}{suffix}", gate_up
                yield f"{owner}.{e}.{self.names.up}{suffix}", gate_up
                if down is not None:
                    yield f"{owner}.{e}.{self.names.down}{suffix}", down

    def _packed_slices(self) -> dict[str, tuple[ShardSlice, ShardSlice | None]]:
        """(gate and up, down) slices of each expert's packed parts: gate's and up's rows (their zero
        points' in words), down's columns in words and groups (a row's one scale, and its zero point, whole)."""
        per_word, group = 32 // self.ints.bits, self.ints.group_size
        columns = ShardSlice(1, self.slice.start, self.slice.stop, self.slice.total)
        grouped = None if group is None else columns.in_units(group)
        parts = {".weight_packed": (self.slice, columns.in_units(per_word)), ".weight_scale": (self.slice, grouped)}
        if not self.ints.symmetric:
            parts[".weight_zero_point"] = (self.slice.in_units(per_word), grouped)
        return parts


def _kept_unit(c: ModelConfig, names: ExpertNames) -> int | None:
    """What a rank's slice of the width must be whole multiples of for the experts to stay in the
    checkpoint's format (MXFP4's group; FP8's blocks, on a device whose Triton reads e4m3; on a
    CUDA device, whole words of integers, and groups, for down's columns and gate's and up's zero
    points' words); None where they are dequantized (integers on the CPU path, whose matmuls run in
    the serving dtype as its dense projections' do, and in GPT-OSS's stacked layout)."""
    if c.quantization == "mxfp4":
        return mxfp4.GROUP
    if c.quantization == "int":
        if names.stacked or fp8.build_capability() is None:
            return None
        return math.lcm(32 // c.int_weights.bits, c.int_weights.group_size or 1)
    if c.quantization != "fp8":
        return None
    return fp8.experts_unit(c.weight_block_size) if fp8.codes_readable(fp8.build_capability()) else None


class SparseMoeBlock(nn.Module):
    def __init__(self, c: ModelConfig, names: ExpertNames, shard: Shard = Shard(),
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, shared_expert: nn.Module | None = None):
        """`shared_expert`: Qwen2-MoE's or GLM-4.5's, an MLP whose output on this rank is a partial sum
        (not reduced)."""
        super().__init__()
        self.router_name, self.shared_name = names.router, names.shared  # registered under the checkpoint's names
        self.choice, self.groups, self.scale = c.moe_choice_bias, c.moe_groups, c.routed_scaling_factor
        # a biased choice's router scores in float32: its weight and the bias kept so, as transformers keeps them
        router = nn.Linear(c.hidden_size, c.num_experts, bias=names.stacked,
                           dtype=None if self.choice is None else torch.float32)
        self.add_module(names.router, router)
        self.choice_bias_name = names.choice_bias
        if self.choice is not None:
            own = names.choice_bias not in ("", names.router)  # Ernie's: a module of its own, [1, experts]
            if own:
                self.add_module(names.choice_bias, nn.Module())
            shape = (1, c.num_experts) if own else (c.num_experts,)
            self._choice_holder().e_score_correction_bias = frozen(*shape, dtype=torch.float32)
        self.experts = Experts(c, names, shard)
        self.add_module(names.shared, shared_expert)
        gated = shared_expert is not None and self.choice is None  # Qwen2-MoE's gate
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if gated else None
        self.top_k, self.renormalize, self.reduce = c.num_experts_per_tok, c.norm_topk_prob, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router = self._modules[self.router_name]
        if self.choice is None:
            weights, experts = route(router(x), self.top_k, self.renormalize)
        else:
            bias = self._choice_holder().e_score_correction_bias.view(-1)
            weights, experts = route_biased(router(x.float()), bias, self.top_k, self.groups, self.renormalize,
                                            self.scale, self.choice)
        out = self.experts(x, weights, experts)
        shared = self._modules[self.shared_name]
        if shared is not None:  # a gate is per token, so it scales a partial sum exactly
            gate = 1.0 if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * shared(x)
        return out if self.reduce is None else self.reduce(out)

    def _choice_holder(self) -> nn.Module:
        """The module whose `e_score_correction_bias` biases the choice (`ExpertNames.choice_bias`)."""
        return self._modules[self.choice_bias_name] if self.choice_bias_name else self


def experts_reference(x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, weights: torch.Tensor, experts: torch.Tensor,
                      act: GatedAct = SILU, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x), up(x))) (gate and up with the
    biases `b13`, down with `b2`), one matmul per expert over the tokens routed to it (`w13[e]`, `w2[e]`: a quantized
    stack dequantizes that expert's alone); each expert's share is rounded to x's dtype as it is added."""
    out, top_k = torch.zeros_like(x), experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # assignment token * k + slot, grouped by expert
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=w13.shape[0]).tolist()):
        if not count:
            continue
        assignments = order[start:start + count]
        start += count
        tokens = assignments // top_k
        gate, up = act.split(F.linear(x[tokens], w13[e], None if b13 is None else b13[e]))
        y = F.linear(act(gate, up), w2[e], None if b2 is None else b2[e]) * weights.flatten()[assignments, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out
