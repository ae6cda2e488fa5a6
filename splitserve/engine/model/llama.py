"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over flattened tokens of many sequences.

Q, K and V are one matmul (`qkv_proj`), and so are the MLP's gate and up (`gate_up_proj`): a
merged weight is the checkpoint's weights stacked by rows. `checkpoint_tensors` names every
parameter, or slice of a merged one, as Hugging Face does, so checkpoints load (and dummy weights
are drawn) by those names. Tokens of all sequences in an iteration are one flat [T] batch (no
padding); the attention backend splits them using the metadata.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.config import ModelConfig
from splitserve.engine.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input as one matmul: the weight is theirs stacked by rows."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts  # the checkpoint's name of each projection -> its output rows, in order

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.parts.values()), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kv = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(c.hidden_size, {"q_proj": self.num_heads * self.head_dim, "k_proj": kv,
                                                     "v_proj": kv}, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x, positions, rotary: RotaryEmbedding, kv: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = backend.forward(q, k, v, kv, meta)
        return self.o_proj(out.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(c.hidden_size, {"gate_proj": c.intermediate_size,
                                                         "up_proj": c.intermediate_size}, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def forward(self, x, positions, rotary, kv, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; KV of every token is written to the cache.
        `after_layer(i)` runs once layer i's KV is in the cache (layer-wise KV streaming starts there)."""
        x = self.model.embed_tokens(input_ids)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(x, positions, self.rotary, kv, meta, backend)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight, in parameter order: a merged projection's
    parts are views of its rows. A tied lm_head yields the embedding's tensor under its name too."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, kind = name.rpartition(".")
        merged = modules.get(owner)
        if not isinstance(merged, MergedLinear):
            yield name, param
            continue
        prefix, start = owner.rpartition(".")[0], 0
        for part, rows in merged.parts.items():
            yield f"{prefix}.{part}.{kind}", param[start:start + rows]
            start += rows
