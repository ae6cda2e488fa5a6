"""Pure-torch paged attention: the correctness oracle and the CPU path.

Decodes are batched into one SDPA call over their gathered, length-masked KV; prefill chunks
run one SDPA call each, with a causal mask offset by the chunk's start when earlier chunks'
KV is in the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.attention.base import AttentionBackend, write_kv
from splitserve.engine.attention.metadata import AttentionMetadata


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self.decode(q[:d], k_cache, v_cache, meta)
        self.run_prefills(q, k, v, k_cache, v_cache, meta, out, range(d, meta.num_seqs))
        return out

    def run_prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out, seqs) -> None:
        for i in seqs:
            lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
            out[lo:hi] = self.prefill_chunk(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, i)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        d = q.shape[0]
        max_len = max(meta.context_lens_list[:d])
        tables = meta.block_tables[:d, : -(-max_len // k_cache.shape[1])]
        keys = _gather(k_cache, tables)[:, :max_len]    # [d, L, KVH, D]
        values = _gather(v_cache, tables)[:, :max_len]
        positions = torch.arange(max_len, device=q.device)
        mask = (positions[None, :] < meta.context_lens[:d, None])[:, None, None, :]  # [d, 1, 1, L]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return out.squeeze(2)

    def prefill_chunk(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, i: int) -> torch.Tensor:
        n, context = q.shape[0], meta.context_lens_list[i]
        if n == context:  # no earlier KV: attend to this chunk's own k, v
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(0, 1)
        table = meta.block_tables[i : i + 1, : -(-context // k_cache.shape[1])]
        keys = _gather(k_cache, table)[0, :context].transpose(0, 1)
        values = _gather(v_cache, table)[0, :context].transpose(0, 1)
        query_pos = torch.arange(context - n, context, device=q.device)
        mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] indexed by [B, nb] -> [B, nb * bs, KVH, D]."""
    b, nb = tables.shape
    return cache[tables].view(b, nb * cache.shape[1], *cache.shape[2:])
