"""BlendServe's cost model (§2.3-2.4): a request's compute-bound time (GEMMs over every token plus
prefill attention) against its memory-bound time (decode attention reading the KV cache), and the
compute density rho = compute time / memory time of a request set.

Only ratios of times are used to order and blend requests, so the accelerator constants set the
scale of rho, not the order: any positive FLOP/s and byte/s give the same schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.config import ModelConfig

KV_BYTES = 2  # fp16 / bf16 K and V elements


@dataclass(frozen=True)
class ModelShape:
    params: float  # parameters every token passes through (all GEMMs, including the LM head; an MoE
    #                layer's router and the experts a token is routed to, not the others)
    hidden: int
    kv_width: int  # total K (or V) width over all KV heads: n_kv_heads x head_dim
    layers: int

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelShape":
        h, q = config.hidden_size, config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        attention = h * (q + 2 * kv) + q * h
        sparse = h * config.num_experts + 3 * h * config.moe_intermediate_size * config.num_experts_per_tok
        if config.shared_expert_intermediate_size:  # Qwen2-MoE: its gate and its MLP
            sparse += h + 3 * h * config.shared_expert_intermediate_size
        mlp = sum(sparse if config.is_moe_layer(i) else 3 * h * config.intermediate_size
                  for i in range(config.num_hidden_layers))
        return cls(config.num_hidden_layers * attention + mlp + h * config.vocab_size, h, kv, config.num_hidden_layers)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_width * self.layers * KV_BYTES


@dataclass(frozen=True)
class Accelerator:
    flops: float  # peak dense fp16 FLOP/s
    bandwidth: float  # HBM bytes/s

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.bandwidth > 0):
            raise ValueError(f"flops and bandwidth must be > 0, got {self.flops}, {self.bandwidth}")


ACCELERATORS = {"a100": Accelerator(312e12, 2.039e12), "h100": Accelerator(989e12, 3.35e12)}


@dataclass(frozen=True)
class CostModel:
    model: ModelShape
    accelerator: Accelerator = ACCELERATORS["a100"]

    def compute_s(self, prompt: float, output: float, prompt_squares: float | None = None) -> float:
        """GEMM time over the prompt and output tokens plus prefill attention over sum(p^2)
        (default: prompt^2, one request)."""
        squares = prompt * prompt if prompt_squares is None else prompt_squares
        return self.gemm_s(prompt + output) + self.attention_s(squares)

    def memory_s(self, prompt: float, output: float) -> float:
        """Decode attention's KV reads: sum over the d decode steps of (p + i) tokens."""
        return self.kv_read_s(prompt * output + 0.5 * output * output)

    def kv_read_s(self, tokens: float) -> float:
        return tokens * self.model.kv_bytes_per_token / self.accelerator.bandwidth

    def attention_s(self, pairs: float) -> float:
        """Prefill attention over `pairs` query-key pairs (a whole prompt of p: p^2)."""
        return pairs * self.model.hidden * self.model.layers * 4 / self.accelerator.flops

    def gemm_s(self, tokens: float) -> float:
        return tokens * self.model.params * 2 / self.accelerator.flops

    def density(self, prompt: int, output: int) -> float:
        """rho of one request; output >= 1 (every request decodes at least one token)."""
        return self.compute_s(prompt, output) / self.memory_s(prompt, max(output, 1))


def partition(memory: float, rho_left: float, rho_right: float, rho_target: float) -> tuple[float, float]:
    """KV memory for the compute-heavy (left) and memory-heavy (right) scanner so that the blend has
    the target density: M_L + M_R = M and M_L rho_L + M_R rho_R = M rho_target. Clamped to [0, M]
    when the target is not between the two densities (one side alone is then closest); an even
    split when the sides are equally dense."""
    if rho_left <= rho_right:
        return memory / 2, memory / 2
    left = min(memory, max(0.0, memory * (rho_target - rho_right) / (rho_left - rho_right)))
    return left, memory - left
