"""Paged attention equals plain attention over contiguous K/V.

Each case scatters every sequence's K/V into a paged cache through a shuffled (non-contiguous)
block table, runs `TorchPagedBackend.forward` on a flat batch of decodes (first) and prefill
chunks (some with earlier context already in the cache), and compares with a per-sequence causal
attention written here from scratch: softmax(Q K^T / sqrt(d)) with a causal mask (and a sliding
window's: the query at p sees positions > p - window), scores optionally scaled otherwise and
soft-capped (cap * tanh(scores / cap)), attention sinks as one more score column per head that is
dropped after the softmax, GQA by `repeat_interleave` of the KV heads. `Scoring.attend` with sinks
is also checked against transformers' GPT-OSS eager attention.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
import types

import pytest
import torch

from splitserve.engine.attention import AttentionMetadata, TorchPagedBackend, fp8_kv, select_backend, torch_paged


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        window: int | None = None, scale: float | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, H, D], the last n positions of a context of len(keys); keys, values: [L, KVH, D]; sinks: [H]."""
    n, heads, dim = q.shape
    length = keys.shape[0]
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)    # [L, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * (scale or 1 / math.sqrt(dim))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(length - n, length)
    allowed = torch.arange(length)[None, :] <= query_pos[:, None]  # [n, L]
    if window is not None:
        allowed &= torch.arange(length)[None, :] > query_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        column = sinks.double()[:, None, None].expand(heads, n, 1)
        probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def build_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int,
               num_blocks: int, seed: int, extra_blocks: int = 0, num_decodes: int | None = None):
    """seqs: (context_len, query_len) pairs, decodes (query_len 1) first. Returns everything a
    forward call needs plus the full per-sequence K/V and the expected cache afterwards."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    # finite garbage everywhere: masked slots must not leak into the result
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    q_parts, k_parts, v_parts, slots, tables, full = [], [], [], [], [], []
    starts, context_lens = [0], []
    for context, n in seqs:
        nb = -(-context // block_size) + extra_blocks
        table = [free.pop() for _ in range(nb)]
        keys = torch.randn(context, kv_heads, dim, generator=gen)
        values = torch.randn(context, kv_heads, dim, generator=gen)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(context)]
        # the earlier context is already in the cache
        for p in range(context - n):
            k_cache.view(-1, kv_heads, dim)[seq_slots[p]] = keys[p]
            v_cache.view(-1, kv_heads, dim)[seq_slots[p]] = values[p]
        q_parts.append(torch.randn(n, heads, dim, generator=gen))
        k_parts.append(keys[context - n:])
        v_parts.append(values[context - n:])
        slots += seq_slots[context - n:]
        tables.append(table)
        full.append((keys, values))
        starts.append(starts[-1] + n)
        context_lens.append(context)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        context_lens=torch.tensor(context_lens, dtype=torch.long),
        query_starts=starts,
        context_lens_list=context_lens,
        num_decodes=_num_decodes(seqs) if num_decodes is None else num_decodes,
        query_start_tensor=torch.tensor(starts, dtype=torch.long),
    )
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, kv_heads, dim)[meta.slot_mapping] = k
    expected_v.view(-1, kv_heads, dim)[meta.slot_mapping] = v
    return q, k, v, k_cache, v_cache, meta, full, (expected_k, expected_v)


def _num_decodes(seqs: list[tuple[int, int]]) -> int:
    """The leading run of single-token queries (the model runner puts decodes first)."""
    count = 0
    for _, n in seqs:
        if n != 1:
            break
        count += 1
    return count


def stored(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as a read of an FP8 cache returns it: its e4m3 code (torch's conversion) times the scale."""
    return fp8_kv.dequantize(fp8_kv.quantize(x, scale), scale, x.dtype)


def check_case(seqs, heads=4, kv_heads=2, dim=8, block_size=4, num_blocks=None, seed=0, extra_blocks=0,
               num_decodes=None, backend=None, dtype=torch.float32, tolerance=1e-5, device="cpu", window=None,
               scale=None, softcap=None, sinks=None, kv_scale=None):
    """`backend` (default: the torch oracle) against the reference, in `dtype` (the reference
    computes in float64 from the same, rounded, inputs); the backend runs on `device`. With
    `kv_scale` (K's, V's), the cache holds FP8 codes (torch's float8_e4m3fn of value / scale), and
    the reference attends to what they stand for, this step's own keys and values too."""
    needed = sum(-(-c // block_size) + extra_blocks for c, _ in seqs)
    num_blocks = num_blocks or needed + 5
    q, k, v, k_cache, v_cache, meta, full, (expected_k, expected_v) = build_case(
        seqs, heads, kv_heads, dim, block_size, num_blocks, seed, extra_blocks, num_decodes)
    q, k, v, k_cache, v_cache, expected_k, expected_v = (
        t.to(dtype) for t in (q, k, v, k_cache, v_cache, expected_k, expected_v))
    full = [(keys.to(dtype), values.to(dtype)) for keys, values in full]
    stored_k = stored_v = lambda x: x  # noqa: E731
    if kv_scale is not None:
        stored_k, stored_v = (functools.partial(fp8_kv.quantize, scale=s) for s in kv_scale)
        full = [(stored(keys, kv_scale[0]), stored(values, kv_scale[1])) for keys, values in full]
        k_cache, v_cache, expected_k, expected_v = (
            stored_k(k_cache), stored_v(v_cache), stored_k(expected_k), stored_v(expected_v))
    kv_cache = torch.stack((k_cache, v_cache)).to(device)  # one layer: [2, num_blocks, block_size, kv_heads, dim]
    on_device = dataclasses.replace(meta, **{name: getattr(meta, name).to(device) for name in
                                             ("slot_mapping", "block_tables", "context_lens", "query_start_tensor")})
    sinks = None if sinks is None else torch.tensor(sinks, dtype=torch.float32)
    out = (backend or TorchPagedBackend()).forward(q.to(device), k.to(device), v.to(device), kv_cache, on_device,
                                                   window, scale, softcap,
                                                   None if sinks is None else sinks.to(device),
                                                   kv_scale or (1.0, 1.0)).cpu()
    k_cache, v_cache = kv_cache.cpu()
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, (keys, values) in enumerate(full):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        want = reference_attention(q[lo:hi], keys, values, window, scale, softcap, sinks)
        torch.testing.assert_close(out[lo:hi].double(), want, atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"sequence {i} {seqs[i]}: {m}")
    # the cache holds this step's k/v at slot_mapping, and every other slot is untouched
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    flat_k = k_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[meta.slot_mapping], stored_k(k))
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[meta.slot_mapping], stored_v(v))


def test_backend_selection_on_cpu():
    assert isinstance(select_backend(torch.device("cpu")), TorchPagedBackend)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_fresh_prefills(heads, kv_heads):
    check_case([(5, 5), (9, 9), (16, 16)], heads=heads, kv_heads=kv_heads, num_decodes=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_decodes(heads, kv_heads):
    check_case([(1, 1), (4, 1), (5, 1), (23, 1)], heads=heads, kv_heads=kv_heads)


def test_prefill_chunks_with_earlier_context():
    check_case([(12, 4), (13, 13), (30, 7), (9, 2)], block_size=4)


def test_decodes_and_chunks_mixed():
    check_case([(7, 1), (1, 1), (33, 1), (20, 5), (6, 6), (40, 17), (3, 2)])


def test_single_token_chunk_in_the_prefill_section():
    """One-token queries in the prefill section (a last chunk of one token, a one-token prompt)
    are handled by the chunk path: same result."""
    check_case([(10, 1), (3, 3), (11, 1), (1, 1)], num_decodes=1)


def test_a_one_token_prompt_in_the_decode_section():
    check_case([(1, 1), (1, 1), (6, 1)])


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.05, 3.0)])
def test_an_fp8_cache(kv_scale):
    """Codes stored, values read back (scaled both ways), fresh prompts, chunks, decodes, a window."""
    check_case([(7, 1), (33, 1), (20, 5), (6, 6), (40, 17)], num_decodes=2, kv_scale=kv_scale)
    check_case([(9, 1), (30, 30), (25, 4)], window=6, kv_scale=kv_scale, dtype=torch.bfloat16, tolerance=2e-2)


def test_one_backend_across_steps_of_every_size_and_cache_dtype():
    """The gather buffer a backend keeps: a smaller gather reuses it (no fresh allocation), and
    what it held before (more blocks, another dtype) never reaches a later step's result."""
    backend = TorchPagedBackend()
    check_case([(70, 1), (45, 1), (60, 9), (33, 33)], backend=backend, seed=1)
    held = backend._gathered.data_ptr()
    check_case([(9, 1), (20, 4)], backend=backend, seed=2, block_size=8)
    assert backend._gathered.data_ptr() == held
    check_case([(30, 1), (12, 5)], backend=backend, seed=3, kv_scale=(0.05, 3.0))
    check_case([(15, 1), (40, 7)], backend=backend, seed=4, dtype=torch.bfloat16, tolerance=2e-2)
    check_case([(50, 1), (8, 1), (26, 3)], backend=backend, seed=5, heads=8, kv_heads=1, dim=16)


def test_padded_block_tables_with_unused_blocks():
    check_case([(5, 1), (2, 1), (14, 3), (9, 9)], extra_blocks=2)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_sizes(block_size):
    check_case([(17, 1), (2, 1), (31, 12), (16, 16)], block_size=block_size)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(seed):
    rng = random.Random(1000 + seed)
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (6, 3), (8, 2), (8, 1)])
    block_size = rng.choice([1, 2, 4, 8, 16])
    decodes = [(rng.randint(1, 50), 1) for _ in range(rng.randint(0, 5))]
    prefills = []
    for _ in range(rng.randint(0 if decodes else 1, 5)):
        context = rng.randint(1, 60)
        prefills.append((context, context if rng.random() < 0.4 else rng.randint(1, context)))
    check_case(decodes + prefills, heads=heads, kv_heads=kv_heads, dim=rng.choice([4, 8, 16]),
               block_size=block_size, seed=seed, num_decodes=len(decodes))


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_a_sliding_window(window):
    """Decodes, fresh prompts longer and shorter than the window, chunks whose window starts in
    their earlier context; a window of 1 sees only the query's own position."""
    check_case([(7, 1), (40, 1), (3, 1), (30, 30), (4, 4), (50, 9), (26, 13)], block_size=4, num_decodes=3,
               window=window)


@pytest.mark.parametrize("window", [None, 6])
def test_scores_scaled_and_soft_capped(window):
    """Gemma 2's scoring: q.k / sqrt(query_pre_attn_scalar) (not head_dim), then 2 * tanh(s / 2),
    a cap low enough to bind; fresh prompts, chunks and decodes."""
    check_case([(7, 1), (30, 1), (12, 12), (40, 9)], num_decodes=2, window=window, scale=0.2, softcap=2.0)


SINKS = [-2.0, 0.0, 8.0, 1.5, -0.5, 3.0, 0.25, -8.0]  # one per head of 8; +8 outweighs every short context's keys

# chunks as a speculative step orders them after the decodes (longest context first): runs of 5-token
# chunks (a decode and 4 drafts), one broken by a 3-token chunk, one by a context under 0.6 of its first
DRAFTED = [(60, 1), (9, 1), (61, 5), (50, 5), (40, 5), (33, 3), (30, 5), (29, 5), (12, 5), (6, 5), (5, 5), (20, 14)]


def test_short_chunks_of_one_length_run_together():
    meta = build_case(DRAFTED, 4, 2, 8, 4, 120, 0, num_decodes=2)[5]
    assert meta.chunk_runs == ((2, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11), (11, 12))
    assert build_case([(40, 33), (39, 33)], 4, 2, 8, 4, 30, 0)[5].chunk_runs == ((0, 1), (1, 2))  # too long


@pytest.mark.parametrize("scoring", [{}, {"window": 4}, {"window": 45}, {"softcap": 2.0, "scale": 0.2},
                                     {"sinks": SINKS}, {"kv_scale": (0.05, 3.0)}])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_runs_of_short_chunks(scoring, block_size):
    """Runs of short chunks after earlier context (a decode and its drafts) attended in one call,
    each query to its own causal prefix (and window) only."""
    check_case(DRAFTED, heads=8, kv_heads=2, block_size=block_size, num_decodes=2, **scoring)


@pytest.mark.parametrize("window", [None, 6])
def test_attention_sinks(window):
    """GPT-OSS's sinks, per query head, GQA groups of 4: decodes, fresh prompts, chunks."""
    check_case([(7, 1), (30, 1), (1, 1), (12, 12), (40, 9), (9, 2)], heads=8, kv_heads=2, num_decodes=3,
               window=window, sinks=SINKS)


@pytest.mark.parametrize("window, scoring", [(None, {"softcap": 2.0}), (None, {"sinks": SINKS}), (1, {}), (5, {}),
                                             (16, {}), (6, {"softcap": 2.0, "scale": 0.2}), (6, {"sinks": SINKS})])
def test_long_chunks_attend_a_tile_of_queries_at_a_time(monkeypatch, window, scoring):
    """Tiles of 8 queries (4 at least with a window): fresh prompts and chunks longer than a tile,
    each tile reading only the keys within its reach (a window's band), equal the whole chunk's
    attention; a fresh prompt SDPA's causal kernel can take (no window binding, no scores made
    here) is never tiled."""
    monkeypatch.setattr(torch_paged, "QUERY_TILE", 8)
    monkeypatch.setattr(torch_paged, "MIN_TILE", 4)
    check_case([(7, 1), (30, 1), (30, 30), (9, 9), (50, 21), (26, 13)], heads=8, kv_heads=2, num_decodes=2,
               window=window, **scoring)
    calls = []
    monkeypatch.setattr(torch_paged, "_tokens_first", lambda *args, **kwargs: calls.append(kwargs) or args[1])
    TorchPagedBackend().prefill_chunk(torch.zeros(30, 8, 4), torch.zeros(30, 2, 4), torch.zeros(30, 2, 4), None,
                                      types.SimpleNamespace(context_lens_list=[30]), 0)
    assert calls == [{"is_causal": True}]


@pytest.mark.parametrize("causal", [True, False])
def test_scoring_with_sinks_is_transformers_gpt_oss_eager_attention(causal):
    """`Scoring.attend` against transformers' own GPT-OSS attention (additive mask, sinks as the
    module's parameter): queries at the end of a longer context, masked by a window (explicit mask)
    or causally, and a float32 softmax from bfloat16 inputs."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from splitserve.engine.attention.base import Scoring

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=gen)
    k, v = torch.randn(2, 2, 11, 16, generator=gen), torch.randn(2, 2, 11, 16, generator=gen)
    sinks = torch.tensor(SINKS)
    query_pos, key_pos = torch.arange(6, 11)[:, None], torch.arange(11)[None, :]
    mask = key_pos <= query_pos
    if not causal:
        mask &= key_pos > query_pos - 4  # a window of 4
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=4, training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    scoring = Scoring(scale=0.3, sinks=sinks)
    got = scoring.attend(q, k, v, is_causal=True) if causal else scoring.attend(q, k, v, mask=mask)
    torch.testing.assert_close(got.transpose(1, 2), want)
    half = scoring.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=mask)
    assert half.dtype == torch.bfloat16
    want_half, _ = eager_attention_forward(module, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                           additive, scaling=0.3)
    torch.testing.assert_close(half.transpose(1, 2).float(), want_half, atol=1e-2, rtol=1e-2)
