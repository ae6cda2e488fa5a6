"""Llama-family decoder (Llama 2/3, Mistral, Ministral 3, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, Granite 3
and 4, OLMo 2 and 3, EXAONE 4, SmolLM3, GLM-4, Cohere 1 and 2, Helium, Ernie 4.5, Seed-OSS, HunYuan,
InternLM3, Arcee, Apertus, Nemotron, and with sparse MoE layers (`model.moe`) Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4.5, Ernie 4.5, MiniMax-M2 and GPT-OSS, whose attention also has sinks and an o_proj
bias) over flattened tokens of many sequences.

Q, K and V are one matmul (`qkv_proj`), and so are the MLP's gate and up (`gate_up_proj`): a
merged weight is the checkpoint's weights stacked by rows (`model.linear`; a block-wise FP8
checkpoint's codes and block scales where the device reads them). `checkpoint_tensors` names every
parameter, or slice of a merged one, as Hugging Face does, so checkpoints load (and dummy weights
are drawn) by those names. Tokens of all sequences in an iteration are one flat [T] batch (no
padding); the attention backend splits them using the metadata.

With tensor parallelism (`model.sharding`) a rank builds only its part: its heads, its slice of
the MLP, an all-reduce (`reduce`) after each row-parallel projection; `shard_slices` says which
part of each checkpoint tensor a rank's parameter holds.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.config import ModelConfig, RopeScaling
from splitserve.engine.config_families import GLM4
from splitserve.engine.model import triton_dispatch
from splitserve.engine.model.activations import UNGATED
from splitserve.engine.model.linear import MergedLinear, Reduce, RowParallelLinear, fp8_block, int_kept
from splitserve.engine.model.lora import LoraSlots
from splitserve.engine.model.moe import Experts, SparseMoeBlock, expert_names
from splitserve.engine.model.rotary import RotaryEmbedding
from splitserve.engine.model.sharding import Shard, ShardSlice, kv_head_range


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, gemma: bool = False):
        """`gemma`: Gemma's norm, which scales by (1 + weight) and rounds once, at the end."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if gemma else torch.ones(size))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) * weight over the last dim; given the residual stream (x and residual [T, size]),
        (norm(x + residual) * weight, x + residual). On CUDA one Triton kernel (`triton_ops`) does
        the add and the norm."""
        if triton_dispatch.runs_kernels(x):
            out, summed = triton_dispatch.ops().add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class LayerNorm(nn.Module):
    """Cohere's: (x - mean) / std * weight over the last dim, in float32, no bias; called as RMSNorm is.
    A `size` of (heads, head_dim) is Command R+'s q or k norm: each head normalized, by its own weight.
    `one_plus`: Nemotron's LayerNorm1P, (x - mean) / std * (1 + weight) + bias."""

    def __init__(self, size: int | tuple[int, int], eps: float, one_plus: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if one_plus else torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if one_plus else None
        self.eps, self.one_plus = eps, one_plus

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        summed = x if residual is None else x + residual
        h = F.layer_norm(summed.float(), summed.shape[-1:], eps=self.eps) * (self.weight.float() + self.one_plus)
        if self.bias is not None:
            h = h + self.bias.float()
        return h.to(x.dtype) if residual is None else (h.to(x.dtype), summed)


def norm_of(c: ModelConfig) -> RMSNorm | LayerNorm:
    """A hidden-size norm of the model's kind: Cohere's or Nemotron's LayerNorm, Gemma's RMSNorm or Llama's."""
    if c.layer_norms:
        return LayerNorm(c.hidden_size, c.rms_norm_eps, c.layer_norm_1p)
    return RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norms)


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig, shard: Shard = Shard(), reduce: Reduce | None = None,
                 window: int | None = None, prefix: str = "model.layers.0.self_attn"):
        """`prefix`: the checkpoint's name of the module (what modules_to_not_convert matches)."""
        super().__init__()
        self.window = window  # a sliding-window layer's (ModelConfig.window_of)
        self.scale, self.softcap = c.attention_scale, c.attn_logit_softcap
        d = self.head_dim = c.head_dim
        q_lo, q_hi = shard.split(c.num_attention_heads)
        kv_lo, kv_hi = kv_head_range(c.num_key_value_heads, shard.rank, shard.size)
        self.num_heads, self.num_kv_heads = q_hi - q_lo, kv_hi - kv_lo
        q_total, kv_total = c.num_attention_heads * d, c.num_key_value_heads * d
        slices = {} if shard.size == 1 else {"q_proj": ShardSlice(0, q_lo * d, q_hi * d, q_total),
                                             "k_proj": ShardSlice(0, kv_lo * d, kv_hi * d, kv_total),
                                             "v_proj": ShardSlice(0, kv_lo * d, kv_hi * d, kv_total)}
        kv = self.num_kv_heads * d
        q_cuts, kv_cuts = (q_lo * d, q_hi * d, q_total), (kv_lo * d, kv_hi * d, kv_total)
        qkv = [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = MergedLinear(c.hidden_size, {"q_proj": self.num_heads * d, "k_proj": kv, "v_proj": kv},
                                     bias=c.attention_bias, slices=slices,
                                     fp8_block=fp8_block(c, qkv, rows=q_cuts + kv_cuts),
                                     ints=int_kept(c, qkv, rows=q_cuts + kv_cuts))
        self.o_proj = RowParallelLinear(self.num_heads * d, c.hidden_size,
                                        ShardSlice(1, q_lo * d, q_hi * d, q_total) if shard.size > 1 else None, reduce,
                                        bias=c.attention_out_bias,
                                        fp8_block=fp8_block(c, [f"{prefix}.o_proj"], cols=q_cuts),
                                        ints=int_kept(c, [f"{prefix}.o_proj"], cols=q_cuts))
        # GPT-OSS: a logit per query head that joins its softmax (this rank's heads)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if c.attention_sinks else None
        self.kv_scale = (1.0, 1.0)  # an FP8 cache's K and V scales: the checkpoint's k_scale, v_scale (loader)
        self.sink_slice = ShardSlice(0, q_lo, q_hi, c.num_attention_heads) if shard.size > 1 else None
        # Qwen3's: one weight per head dim, the same for every head, whole on every rank; OLMo's
        # (across_heads): one per row of the projection, a rank holding its heads' rows
        self.across_heads, self.norms_after_rotary = c.qk_norm_across_heads, c.qk_norm_after_rotary
        slices = {}
        if c.qk_norm and c.layer_norms:  # Command R+'s: a LayerNorm weight per head, a rank holding its heads'
            self.q_norm = LayerNorm((self.num_heads, d), c.rms_norm_eps)
            self.k_norm = LayerNorm((self.num_kv_heads, d), c.rms_norm_eps)
            slices = {"q_norm": ShardSlice(0, q_lo, q_hi, c.num_attention_heads),
                      "k_norm": ShardSlice(0, kv_lo, kv_hi, c.num_key_value_heads)}
        elif c.qk_norm:
            widths = (self.num_heads * d, kv) if self.across_heads else (d, d)
            self.q_norm, self.k_norm = (RMSNorm(w, c.rms_norm_eps, c.gemma_norms) for w in widths)
            if self.across_heads:
                slices = {"q_norm": ShardSlice(0, *q_cuts), "k_norm": ShardSlice(0, *kv_cuts)}
        else:
            self.q_norm = self.k_norm = None
        self.norm_slices = slices if shard.size > 1 else {}
        # an all-reduced sum of squares counts a KV head once per rank holding it
        self.reduce, self.kv_copies = reduce, max(1, shard.size // c.num_key_value_heads)
        self.widths = (q_total, kv_total)

    def forward(self, x, positions, rotary: RotaryEmbedding | None, kv: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`rotary`: None in a layer that does not turn q and k (SmolLM3's, EXAONE 4's); `q_scale`
        [T, 1, 1]: what q is scaled by after it (Ministral 3's, `query_scale`)."""
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        parts = self.qkv_proj.split(self.qkv_proj(x))
        if self.across_heads:
            parts, norms = (*self._norm_across_heads(*parts[:2]), parts[2]), None
        q, k, v = self.heads(*parts)
        first = norms if rotary is not None and not self.norms_after_rotary else None  # the rotation's own
        if rotary is not None:
            q, k = rotary(positions, q, k, first)
        if norms is not None and first is None:
            q, k = norms[0](q), norms[1](k)
        if q_scale is not None:
            q = q * q_scale
        out = backend.forward(q, k, v, kv, meta, self.window, self.scale, self.softcap, self.sinks, self.kv_scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _norm_across_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo's q and k norms, each over all of its projection's heads ([T, heads * head_dim]): on
        one rank its RMSNorm; a rank of several holds some heads, so the sums of squares are
        all-reduced first."""
        if self.reduce is None:
            return self.q_norm(q), self.k_norm(k)
        sums = self.reduce(torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1))
        means = (sums[:, 0] / self.widths[0], sums[:, 1] / (self.widths[1] * self.kv_copies))
        return tuple(norm.weight * (part.float() * torch.rsqrt(mean[:, None] + norm.eps)).to(part.dtype)
                     for part, mean, norm in ((q, means[0], self.q_norm), (k, means[1], self.k_norm)))

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim]: views of the fused projection's
        parts (`qkv_proj.split`)."""
        t = q.shape[0]
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig, shard: Shard = Shard(), reduce: Reduce | None = None, width: int | None = None,
                 prefix: str = "model.layers.0.mlp"):
        """`width`: the intermediate size (default the config's); without `reduce` a sharded MLP's
        output is this rank's partial sum. `prefix`: the checkpoint's name of the module (as for attention)."""
        super().__init__()
        width = width or c.intermediate_size
        lo, hi = shard.split(width)
        sharded = shard.size > 1
        part = ShardSlice(0, lo, hi, width)
        # an MLP without a gate (Arcee's, Apertus's, Nemotron's) has up_proj alone, then its activation (`act_fn`)
        names = ("gate_proj", "up_proj") if c.mlp_gated else ("up_proj",)
        gate_up = [f"{prefix}.{name}" for name in names]
        self.gate_up_proj = MergedLinear(c.hidden_size, {name: hi - lo for name in names}, bias=c.mlp_bias,
                                         slices={name: part for name in names} if sharded else {},
                                         fp8_block=fp8_block(c, gate_up, rows=(lo, hi, width)),
                                         ints=int_kept(c, gate_up, rows=(lo, hi, width)))
        down = [f"{prefix}.down_proj"]
        self.down_proj = RowParallelLinear(hi - lo, c.hidden_size, ShardSlice(1, lo, hi, width) if sharded else None,
                                           reduce, bias=c.mlp_bias, fp8_block=fp8_block(c, down, cols=(lo, hi, width)),
                                           ints=int_kept(c, down, cols=(lo, hi, width)))
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        self.act_fn = None if c.mlp_gated else UNGATED[c.hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On CUDA the gated activation is one Triton kernel (`triton_ops.gated`); an ungated one
        torch's ops."""
        if self.act_fn is not None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        if triton_dispatch.runs_kernels(x):
            return self.down_proj(triton_dispatch.ops().gated(gate, up, self.gelu))
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, shard: Shard = Shard(), reduce: Reduce | None = None):
        super().__init__()
        self.input_layernorm = None if c.norms_after else norm_of(c)
        prefix = f"model.layers.{layer}"
        self.self_attn = LlamaAttention(c, shard, reduce, c.window_of(layer), f"{prefix}.self_attn")
        self.norm_names = _norm_names(c)
        for name in filter(None, self.norm_names):
            self.add_module(name, norm_of(c))
        self.residual_multiplier, self.parallel = c.residual_multiplier, c.parallel_block  # Granite's, Cohere's
        if c.is_moe_layer(layer):  # registered under the checkpoint's name (Mixtral's block_sparse_moe)
            names, width = expert_names(c), c.shared_expert_intermediate_size
            self.mlp_name = names.block
            shared = LlamaMLP(c, shard, width=width, prefix=f"{prefix}.{names.block}.{names.shared}") if width else None
            self.add_module(names.block, SparseMoeBlock(c, names, shard, reduce, shared))
        else:
            self.mlp_name, self.mlp = "mlp", LlamaMLP(c, shard, reduce, prefix=f"{prefix}.mlp")

    def forward(self, x, residual, positions, rotary, kv, meta, backend, q_scale=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two,
        so each add runs inside a norm; the first layer has no residual yet."""
        attention_out, mlp_in, mlp_out = (None if name is None else self._modules[name] for name in self.norm_names)
        mlp = self._modules[self.mlp_name]
        if self.input_layernorm is None:  # OLMo: each sublayer's output normalized, its input not
            x = x if residual is None else x + residual
            x = x + attention_out(self.self_attn(x, positions, rotary, kv, meta, backend, q_scale))
            return mlp_out(mlp(x)), x
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        if self.parallel:  # Cohere: both read the normed input
            return self.self_attn(h, positions, rotary, kv, meta, backend, q_scale) + mlp(h), residual
        h = self.self_attn(h, positions, rotary, kv, meta, backend, q_scale)
        if attention_out is not None:
            h = attention_out(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = mlp_in(h, residual)
        h = mlp(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        return (h if mlp_out is None else mlp_out(h)), residual


def _norm_names(c: ModelConfig) -> tuple[str | None, str | None, str | None]:
    """The checkpoint's names of a layer's norms of the attention's output, the MLP's input and the
    MLP's output, beside input_layernorm (None: the layer has no such norm): Llama's one before the
    MLP; Gemma's and GLM-4's all three; OLMo's the two outputs' (and no input_layernorm); Cohere's
    none (its parallel block reads input_layernorm's output twice)."""
    if c.parallel_block:
        return None, None, None
    if c.norms_after:
        return "post_attention_layernorm", None, "post_feedforward_layernorm"
    if c.architecture == GLM4:
        return "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"
    if c.gemma_norms:
        return "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
    return None, "post_attention_layernorm", None


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig, shard: Shard = Shard(), reduce: Reduce | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, shard, reduce) for i in range(c.num_hidden_layers))
        self.norm = norm_of(c)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, shard: Shard = Shard(), reduce: Reduce | None = None):
        """`shard`: this rank's part of the model; `reduce` the all-reduce over the ranks (with size > 1)."""
        super().__init__()
        if shard.size > 1 and reduce is None:
            raise ValueError("a sharded model needs `reduce`, the all-reduce over its ranks")
        self.config, self.shard = config, shard
        self.lora_slots = LoraSlots()  # its LoRA adapter slots and the adapters in host memory (model_builder)
        self.model = LlamaModel(config, shard, reduce)
        # the LM head lives where sampling happens (rank 0); a tied one is the replicated embedding
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) \
            if shard.rank == 0 or config.tie_word_embeddings else None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_model_len)
        # Gemma 3's sliding layers turn at a base of their own, unscaled
        local = config.local_rope_theta is not None
        self.local_rotary = RotaryEmbedding(replace(config, rope_theta=config.local_rope_theta,
                                                    rope_scaling=RopeScaling()), max_model_len) if local else None
        self.rotary_of = [None if i in config.nope_layers else self.local_rotary if local and layer.self_attn.window
                          else self.rotary for i, layer in enumerate(self.model.layers)]

    @property
    def absent_tensors(self) -> frozenset[str]:
        """Checkpoint tensors this rank does not hold at all."""
        return frozenset() if self.lm_head is not None else frozenset({"lm_head.weight"})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttentionMetadata], backend: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; KV of every token is written to the cache.
        `kv_caches` and `metas`: per layer (a layer group's metadata names its own block tables).
        `after_layer(i)` runs once layer i's KV is in the cache (layer-wise KV streaming starts there)."""
        x, residual = self.model.embed_tokens(input_ids), None
        if self.config.gemma_norms:  # Gemma scales by sqrt(hidden_size), rounded to the activations' dtype
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        if self.config.embedding_multiplier != 1.0:  # Granite's
            x = x * self.config.embedding_multiplier
        scaled = self.config.query_position_scale
        q_scale = None if scaled is None else query_scale(positions, x.dtype, *scaled)
        for i, (layer, kv, meta) in enumerate(zip(self.model.layers, kv_caches, metas)):
            x, residual = layer(x, residual, positions, self.rotary_of[i], kv, meta, backend, q_scale)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0 only (the others have no LM head)."""
        logits = self.lm_head(hidden)
        if self.config.logits_scale != 1.0:  # Granite's, Cohere's
            logits = logits * self.config.logits_scale
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def query_scale(positions: torch.Tensor, dtype: torch.dtype, beta: float, span: int) -> torch.Tensor:
    """Ministral 3's (Llama 4's) query scale at each position [T, 1, 1], computed once a step:
    1 + beta * log(1 + floor(position / span)), as transformers computes it, in float32."""
    return (1 + beta * torch.log(1 + torch.floor(positions / span))).to(dtype)[:, None, None]


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight, in parameter order: a merged projection's
    parts are views of its rows, each expert's projections views of the stacked experts. A tied
    lm_head yields the embedding's tensor under its name too."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, kind = name.rpartition(".")
        merged = modules.get(owner)
        if isinstance(merged, Experts):
            yield from merged.checkpoint_tensors(owner, kind)
            continue
        if not isinstance(merged, MergedLinear):
            yield name, param
            continue
        prefix = owner.rpartition(".")[0]
        for part, start, rows in merged.part_rows(param):
            yield f"{prefix}.{part}.{kind}", param[start:start + rows]


def shard_slices(model: nn.Module) -> dict[str, ShardSlice]:
    """Hugging Face name -> the part of that checkpoint tensor this rank's parameter holds; names
    not listed are held whole."""
    found = {}
    for owner, module in model.named_modules():
        prefix = owner.rpartition(".")[0]
        if isinstance(module, MergedLinear):
            found.update(module.shard_slices(prefix))
        elif isinstance(module, RowParallelLinear):
            found.update(module.shard_slices(owner))
        elif isinstance(module, LlamaAttention):
            if module.sinks is not None and module.sink_slice is not None:
                found[f"{owner}.sinks"] = module.sink_slice
            found.update({f"{owner}.{norm}.weight": part for norm, part in module.norm_slices.items()})
        elif isinstance(module, Experts):
            found.update(module.shard_slices(owner))
    return found
