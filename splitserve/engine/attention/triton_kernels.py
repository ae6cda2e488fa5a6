"""Triton kernels for paged attention: the KV-cache store, decode over block tables (GQA, split-K
for long contexts) and prefill / chunk attention over the paged context (varlen, causal), either
over the whole context or a sliding window (`window` > 0: the query at p attends to positions
> p - window; the key tiles wholly before it are not read), with scores soft-capped where a model
says so (SOFTCAP: softcap * tanh(scores / softcap), Gemma 2) and attention sinks where it has them
(SINKS: head h's softmax also counts a logit sinks[h] with no value, GPT-OSS; it joins the running
max and sum once, after the keys, or at the merge of a split decode). An FP8 cache (FP8_KV: uint8
e4m3 codes, `fp8_kv`) is read a byte a value and widened in registers, unscaled: by the GPU's own
e4m3 conversion where it has one (NATIVE_FP8: sm_89 and later), else by integer bit moves to the
values / 2**8 (an A100); the layer's K scale (over that unit) joins the score scale and its V
scale multiplies the output once, so no scale costs a multiply per key.

Softmax runs in base 2: a score's log2 weight is its dot times `to_log2` (the score scale times
log2(e), or log2(e) alone after a soft cap, which applies the scale itself), so with the running
max subtracted it is one fused multiply-add before exp2. The scale is positive, so the max of the
dots scaled is the scaled max.

Layouts (the engine's): one layer's cache is [2 (K, V), num_blocks, block_size, kv_heads, head_dim],
contiguous; queries are [tokens, heads, head_dim]; block tables [seqs, max_pages] (padded with 0,
read only below a sequence's context length). A key tile gathers BLOCK_N consecutive positions,
across pages, so tiles stay large whatever the block size. Softmax is online (running max and
sum in float32); every query attends at least to its own position, so no row is empty.

On CPU these run under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them
against the torch backend; on CUDA they compile, once per variant: Triton specializes integers that
are 1 or multiples of 16 and pointers that are 16-byte aligned. What changes from step to step is
kept out of that (`STEP_INTS`, `STEP_POINTERS`: the block tables' width, where prefills start, the
batch size; the step inputs, views at any offset into one buffer), and so is a layer's window, so a
step's variant depends only on the model, the dtype and the decode split count, and `kernel_warm_up`
can compile them all at start-up (scripts/compile_kernels.py checks it).
"""
from __future__ import annotations

import triton
import triton.language as tl

from splitserve.engine.triton_e4m3 import e4m3_codes

LOG2E = tl.constexpr(1.4426950408889634)
STEP_INTS = ["stride_table", "first_seq", "num_seqs", "window"]  # window: per layer, not per step
STEP_POINTERS = ["slots_ptr", "tables_ptr", "context_ptr", "query_starts_ptr"]


def _step_jit(fn):
    """triton.jit, leaving the kernel's step-varying arguments (of STEP_INTS, STEP_POINTERS) unspecialized."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[n for n in STEP_INTS if n in names],
                      do_not_specialize_on_alignment=[n for n in STEP_POINTERS if n in names])


@_step_jit
def store_kv_kernel(k_ptr, v_ptr, cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh, kv_offset,
                    stride_slot, stride_head, k_inverse, v_inverse, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    FP8_KV: tl.constexpr):
    """One program per (token, kv head): K and V of this token into its cache slot, with FP8_KV as
    the e4m3 codes of K * k_inverse and V * v_inverse (1 / the scales). A negative slot (PAD_SLOT: a
    padding row of a captured batch) is stored nowhere."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)  # token * stride passes 2**31 in long steps
    slot = tl.load(slots_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # A padding slot has no lanes. The slot test is folded into the lane bound so the mask is one
    # block comparison: `block & scalar` comes out int32 in Triton's interpreter, which 3.9 refuses.
    mask = d < tl.where(slot >= 0, HEAD_DIM, 0)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    if FP8_KV:
        k, v = e4m3_codes(k.to(tl.float32) * k_inverse), e4m3_codes(v.to(tl.float32) * v_inverse)
    base = cache_ptr + slot * stride_slot + head * stride_head + d
    tl.store(base, k, mask=mask)
    tl.store(base + kv_offset, v, mask=mask)


@triton.jit
def _key_tile(cache_ptr, tables_ptr, seq, stride_table, start, context, kv_head, kv_offset, stride_block,
              stride_slot, stride_head, d, dmask, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              WHOLE: tl.constexpr = False):
    """K and V ([BLOCK_N, BLOCK_D] each) of positions start .. start + BLOCK_N, gathered across pages.
    WHOLE: the caller knows every position is below `context`, so the loads are not masked by it."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < context
    blocks = tl.load(tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=None if WHOLE else nmask,
                     other=None if WHOLE else 0).to(tl.int64)
    offsets = blocks[:, None] * stride_block + (n % BLOCK_SIZE)[:, None] * stride_slot + kv_head * stride_head
    mask = dmask[None, :] if WHOLE else nmask[:, None] & dmask[None, :]
    k = tl.load(cache_ptr + offsets + d[None, :], mask=mask, other=0.0)
    v = tl.load(cache_ptr + kv_offset + offsets + d[None, :], mask=mask, other=0.0)
    return k, v, n, nmask


@triton.jit
def _widened(x, like, FP8_KV: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """A K or V tile in `like`'s dtype: FP8 codes widened unscaled, to their values (NATIVE_FP8) or
    to the values / 2**8 (`_e4m3_halves`), either exact in float16, bfloat16 and float32. V is
    widened only for its dot, so the two widened tiles are never live at once (registers)."""
    if FP8_KV:
        if NATIVE_FP8:
            x = x.to(tl.float8e4nv, bitcast=True).to(like.dtype)
        else:
            x = _e4m3_halves(x).to(like.dtype)
    return x


@triton.jit
def _e4m3_halves(codes):
    """float16 of e4m3 codes' values / 2**8, in integer bit moves any GPU has: sign to bit 15 and the
    7 exponent and mantissa bits to bits 7..13 (e4m3's exponent bias is 7, float16's 15), subnormals
    included. Codes 0x7f / 0xff (NaN) read as +-480 / 2**8."""
    bits = codes.to(tl.uint16)
    return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _add_sink(m, l, sink):
    """(factor, sum): the online softmax of max m, sum l, with one more logit `sink` of no value
    (m and sink in log2 units); the accumulator is multiplied by factor. Rescaled to max(m, sink),
    so nothing overflows, and m may be -inf (no key)."""
    top = tl.maximum(m, sink)
    factor = tl.math.exp2(m - top)
    return factor, l * factor + tl.math.exp2(sink - top)


@triton.jit
def _scores(q, k, scale, softcap, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """q . k for each query and key: as they are (the caller's `to_log2` scales them), or with
    SOFTCAP scaled and capped, softcap * tanh(s * scale / softcap), tanh as 1 - 2 / (exp(2x) + 1)
    (exact at both infinities)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s * scale / softcap) + 1.0))
    return s


@_step_jit
def paged_decode_kernel(q_ptr, cache_ptr, tables_ptr, context_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
                        stride_qt, stride_qh, stride_table, kv_offset, stride_block, stride_slot, stride_head,
                        stride_ot, stride_oh, num_heads, scale, to_log2, window, softcap, v_scale,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                        SINKS: tl.constexpr, FP8_KV: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """One program per (decode sequence, kv head, split): the GROUP query heads that share this KV
    head attend to this split's key tiles. One split writes the output, sinks counted; several
    write partial (unnormalized accumulator, max in log2 units, sum; no sinks) for `merge_splits_kernel`. Each
    sequence's key tiles are divided over the splits by its own context (read on the device), so a
    launch depends only on the batch size and NUM_SPLITS, which a captured CUDA graph fixes; a
    split past a short context has no keys."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(context_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask, dmask = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    oldest = tl.where(window > 0, tl.maximum(context - window, 0), 0)  # the first key attended
    skipped = oldest // BLOCK_N
    tiles = tl.cdiv(context, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles - skipped, NUM_SPLITS)
    first = skipped + split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tiles)
    for tile in range(first, last):
        k, v, n, nmask = _key_tile(cache_ptr, tables_ptr, seq, stride_table, tile * BLOCK_N, context, kv_head,
                                   kv_offset, stride_block, stride_slot, stride_head, d, dmask, BLOCK_N, BLOCK_SIZE)
        s = _scores(q, _widened(k, q, FP8_KV, NATIVE_FP8), scale, softcap, PRECISION, SOFTCAP)
        s = tl.where(nmask[None, :] & (n[None, :] >= oldest), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * to_log2)  # every tile holds a key: m_new is finite
        l, acc = _softmax_step(m, m_new, l, acc, s, v, q, to_log2, PRECISION, FP8_KV, NATIVE_FP8)
        m = m_new
    acc = acc * v_scale
    out_mask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        if SINKS:
            factor, l = _add_sink(m, l, tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32) * LOG2E)
            acc = acc * factor[:, None]
        out = acc / l[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (split * tl.num_programs(0) + seq) * num_heads + heads  # partials: [splits, seqs, heads, ...]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=gmask)


@_step_jit
def merge_splits_kernel(part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, num_seqs, num_heads, stride_ot, stride_oh,
                        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """One program per (decode sequence, head): the splits' partial softmaxes rescaled to a common
    max (log2 units) and summed (a split with no keys has max -inf and weighs nothing); with SINKS,
    the head's sink logit joins the common max and adds its weight to the sum, once."""
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    row = (s * num_seqs + seq) * num_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    top = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        top = tl.maximum(top, sink)
    weight = tl.where(m > float("-inf"), tl.math.exp2(m - top), 0.0)
    total = tl.sum(l * weight, 0)
    if SINKS:
        total += tl.math.exp2(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@_step_jit
def paged_prefill_kernel(q_ptr, cache_ptr, tables_ptr, context_ptr, query_starts_ptr, out_ptr, sinks_ptr, first_seq,
                         stride_qt, stride_qh, stride_table, kv_offset, stride_block, stride_slot, stride_head,
                         stride_ot, stride_oh, scale, to_log2, window, softcap, v_scale, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                         SINKS: tl.constexpr, FP8_KV: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """One program per (prefill sequence, query head, BLOCK_M queries), the query tiles with the most
    keys launched first (the grid's last tiles are its tail). A chunk's queries sit at the end of
    its context (earlier chunks and prefix-cache hits are already in the cache, this chunk's own K
    and V were just stored), so query i attends to positions <= context - query_len + i. The key
    tiles every row sees whole (below the tile's first query, inside its last query's window) skip
    the masking; those at the diagonal and at a window's start are masked."""
    seq = first_seq + tl.program_id(0)
    head, mblock = tl.program_id(1), tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    if mblock * BLOCK_M < q_len:
        context = tl.load(context_ptr + seq)
        rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        rmask, dmask = rows < q_len, d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        positions = context - q_len + rows
        oldest = tl.where(window > 0, positions - window + 1, 0)  # each row's first key
        top = context - q_len + mblock * BLOCK_M  # the first row's position, and the last real row's:
        bottom = context - q_len + tl.minimum(q_len, (mblock + 1) * BLOCK_M) - 1
        first = tl.where(window > 0, tl.maximum(top - window + 1, 0) // BLOCK_N, 0)
        end = tl.cdiv(bottom + 1, BLOCK_N)  # past the tile's causal horizon
        whole = tl.where(window > 0, tl.cdiv(tl.maximum(bottom - window + 1, 0), BLOCK_N), 0)
        whole = tl.minimum(tl.maximum(whole, first), end)  # the first tile every row sees whole
        past = tl.minimum(tl.maximum((top + 1) // BLOCK_N, whole), end)  # the first at the diagonal
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for masked in tl.static_range(2):  # the tiles whole .. past, then the rest: first .. whole, past .. end
            lo, hi, gap = (first, whole + end - past, past - whole) if masked else (whole, past, 0)
            m, l, acc = _prefill_tiles(m, l, acc, q, lo, hi, whole, gap, positions, oldest, cache_ptr,
                                       tables_ptr, seq, stride_table, context, head // GROUP, kv_offset,
                                       stride_block, stride_slot, stride_head, d, dmask, scale, to_log2, softcap,
                                       masked == 1, BLOCK_N, BLOCK_SIZE, PRECISION, SOFTCAP, FP8_KV, NATIVE_FP8)
        acc = acc * v_scale
        if SINKS:
            factor, l = _add_sink(m, l, tl.load(sinks_ptr + head).to(tl.float32) * LOG2E)
            acc = acc * factor[:, None]
        out = acc / l[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _prefill_tiles(m, l, acc, q, lo, hi, gap_at, gap, positions, oldest, cache_ptr, tables_ptr, seq, stride_table,
                   context, kv_head, kv_offset, stride_block, stride_slot, stride_head, d, dmask, scale, to_log2,
                   softcap, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """The online softmax (max m in log2 units, sum l, accumulator acc) of a query tile carried over
    key tiles lo .. hi, skipping `gap` tiles at `gap_at`; MASKED, each row sees only the keys from
    its `oldest` to its position."""
    for i in range(lo, hi):
        tile = i + tl.where(i >= gap_at, gap, 0)
        k, v, n, nmask = _key_tile(cache_ptr, tables_ptr, seq, stride_table, tile * BLOCK_N, context, kv_head,
                                   kv_offset, stride_block, stride_slot, stride_head, d, dmask, BLOCK_N, BLOCK_SIZE,
                                   not MASKED)  # the tiles every row sees whole are below the context
        s = _scores(q, _widened(k, q, FP8_KV, NATIVE_FP8), scale, softcap, PRECISION, SOFTCAP)
        if MASKED:
            s = tl.where((n[None, :] <= positions[:, None]) & (n[None, :] >= oldest[:, None]) & nmask[None, :], s,
                         float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * to_log2)
        base = m_new
        if MASKED:
            # a row may have no key yet (its window starts past this tile): its max stays -inf, and
            # exp2(-inf - -inf) would be nan, so the exponent base is 0 until it has one
            base = tl.where(m_new > float("-inf"), m_new, 0.0)
        l, acc = _softmax_step(m, base, l, acc, s, v, q, to_log2, PRECISION, FP8_KV, NATIVE_FP8)
        m = m_new
    return m, l, acc


@triton.jit
def _softmax_step(m, base, l, acc, s, v, q, to_log2, PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
                  NATIVE_FP8: tl.constexpr):
    """(sum, accumulator) of the online softmax over one more key tile: its keys weighted
    exp2(s * to_log2 - base), base the running max after the tile (log2 units), what was summed
    before rescaled from the max m before it."""
    p = tl.math.exp2(s * to_log2 - base[:, None])
    alpha = tl.math.exp2(m - base)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), _widened(v, q, FP8_KV, NATIVE_FP8), input_precision=PRECISION)
    return l, acc
