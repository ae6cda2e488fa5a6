"""Pure-torch paged attention: the correctness oracle and the CPU path.

Decodes are batched, one SDPA call per group of similar context lengths, over their gathered,
length-masked KV, and so are runs of short chunks of one length after earlier context (a decode
and its drafts: `AttentionMetadata.chunk_runs`); other prefill chunks run one SDPA call each,
with a causal mask offset by the chunk's start when earlier chunks' KV is in the cache. A sliding
window masks the keys at or before position p - window for the query at p, and the blocks wholly
before every query's window are not gathered (so a windowed layer's cost follows its window, not
the context, and the blocks a block manager released are never read); `Scoring` gives the
scores' scale and soft cap, and the sinks' logits. An FP8 cache is read dequantized (`fp8_kv`),
this step's own K and V too. A chunk longer than a query tile (`QUERY_TILE`, or about a window)
that SDPA's causal kernel cannot take whole attends a tile of queries at a time, each to the keys
within its reach: a window's long prompt costs its length times about two windows, not its length
squared, and scores made here (soft caps, sinks) are held a tile's worth at a time.
Gathers land in one buffer the backend keeps, grown to the largest gather so far: each is read
before the next is made, and a fresh buffer of that size a layer would be faulted in anew each
time (glibc returns large freed blocks to the kernel), which costs more than the copy itself.
"""
from __future__ import annotations

import math

import torch

from splitserve.engine.attention import fp8_kv
from splitserve.engine.attention.base import AttentionBackend, Scoring, write_kv
from splitserve.engine.attention.metadata import AttentionMetadata

QUERY_TILE = 1024  # queries attended at once, at most
MIN_TILE = 64  # ... and at least (a window shorter than this still takes tiles this long)


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._gathered = torch.empty(0)  # flat; holds the latest gather

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, window: int | None = None,
                scale: float | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        k, v = write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
        out = torch.empty_like(q)
        scoring = Scoring(scale, softcap, sinks)
        for first, end in meta.decode_groups:
            out[first:end] = self.attend_queries(q[first:end], kv_cache, meta, first, 1, window, scoring, kv_scale)
        starts = meta.query_starts
        for first, end in meta.chunk_runs:
            lo, hi = starts[first], starts[end]
            if end - first > 1:
                n = starts[first + 1] - lo
                out[lo:hi] = self.attend_queries(q[lo:hi], kv_cache, meta, first, n, window, scoring, kv_scale)
            else:
                out[lo:hi] = self.prefill_chunk(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, meta, first, window,
                                                scoring, kv_scale)
        return out

    def attend_queries(self, q, kv_cache, meta: AttentionMetadata, first: int, n: int, window: int | None = None,
                       scoring: Scoring | None = None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """The last n positions of each of sequences first .. first + len(q) // n (decodes: n = 1; a
        decode and its drafts), their keys all in the cache, batched in one SDPA call."""
        g, bs = q.shape[0] // n, kv_cache.shape[2]
        lens = meta.context_lens_list[first:first + g]
        max_len = max(lens)
        lo = _first_block(min(lens) - n, window, bs)  # the query at p reads keys > p - window
        tables = meta.block_tables[first:first + g, lo : -(-max_len // bs)]
        keys, values = (_read(x[:, :max_len - lo * bs].transpose(1, 2), q.dtype, s)  # each [g, KVH, L, D]
                        for x, s in zip(self._gather(kv_cache, tables), kv_scale))
        positions = torch.arange(lo * bs, max_len, device=q.device)
        query_pos = meta.context_lens[first:first + g, None] - n + torch.arange(n, device=q.device)  # [g, n]
        mask = positions <= query_pos[:, :, None]
        if window is not None:
            mask &= positions > query_pos[:, :, None] - window
        queries = q.view(g, n, *q.shape[1:]).transpose(1, 2)  # [g, H, n, D]
        out = (scoring or Scoring()).attend(queries, keys, values, mask[:, None])
        return out.transpose(1, 2).reshape(q.shape)

    def prefill_chunk(self, q, k, v, kv_cache, meta: AttentionMetadata, i: int, window: int | None = None,
                      scoring: Scoring | None = None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """k, v: this chunk's, as the cache returns them."""
        n, context, scoring = q.shape[0], meta.context_lens_list[i], scoring or Scoring()
        tile = QUERY_TILE if window is None else max(MIN_TILE, min(window, QUERY_TILE))
        if n == context and (window is None or window >= n) and (scoring.fused or n <= tile):
            return _tokens_first(scoring.attend, q, k, v, is_causal=True)  # no earlier KV, nothing out of the window
        first, start = context - n, 0  # the chunk's first position; the first key held in keys / values
        if n == context:
            keys, values = k, v
        else:
            bs = kv_cache.shape[2]
            lo = _first_block(first, window, bs)
            start = lo * bs
            table = meta.block_tables[i : i + 1, lo : -(-context // bs)]
            keys, values = (_read(x[0, :context - start], q.dtype, s)
                            for x, s in zip(self._gather(kv_cache, table), kv_scale))
        out = torch.empty_like(q)
        for a in range(0, n, tile):
            b = min(n, a + tile)
            reach = start if window is None else max(start, first + a - window + 1)  # the tile's first key
            query_pos = torch.arange(first + a, first + b, device=q.device)[:, None]
            key_pos = torch.arange(reach, first + b, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            held = slice(reach - start, first + b - start)
            out[a:b] = _tokens_first(scoring.attend, q[a:b], keys[held], values[held], mask=mask)
        return out

    def _gather(self, kv_cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """K and V of the blocks in `tables` [B, nb], in one index op (about twice as fast on CPU as
        two), into the kept buffer: [2, num_blocks, bs, KVH, D] -> [2, B, nb * bs, KVH, D], valid
        until the next gather."""
        b, nb = tables.shape
        shape = (2, b * nb, *kv_cache.shape[2:])
        size = math.prod(shape)
        held = self._gathered
        if held.numel() < size or held.dtype != kv_cache.dtype or held.device != kv_cache.device:
            held = self._gathered = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
        out = held[:size].view(shape)
        torch.index_select(kv_cache, 1, tables.reshape(-1), out=out)
        return out.view(2, b, nb * kv_cache.shape[2], *kv_cache.shape[3:])


def _first_block(query_pos: int, window: int | None, block_size: int) -> int:
    """The first block a query at `query_pos` (or later) reads: keys > query_pos - window."""
    return 0 if window is None else max(0, query_pos - window + 1) // block_size


def _tokens_first(attend, q, k, v, **kwargs) -> torch.Tensor:
    """Attention on [tokens, heads, dim] tensors. Inputs go in 4-D ([1, heads, tokens, dim]): with 3-D
    ones, CPU torch's SDPA falls back to its slow math kernel instead of its flash kernel."""
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], **kwargs)
    return out[0].transpose(0, 1)


def _read(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gathered K or V as values: FP8 codes dequantized, values as they are."""
    return fp8_kv.dequantize(x, scale, dtype) if fp8_kv.holds_codes(x) else x
