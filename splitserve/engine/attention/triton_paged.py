"""Paged attention with Triton kernels (`triton_kernels.py`): the default on CUDA. Every step is
three launches per layer at most, whatever the batch: store this step's K and V, attend all
decodes (split over the context when the batch is too small to fill the GPU, then merged), and
attend all prefill chunks; nothing is copied out of the cache and nothing waits on the host. An
FP8 cache's codes are made by the store and widened by the attention kernels."""
from __future__ import annotations

import math

import torch
import triton

from splitserve.engine.attention import fp8_kv
from splitserve.engine.attention import triton_kernels as kernels
from splitserve.engine.attention.base import AttentionBackend, Scoring
from splitserve.engine.attention.metadata import AttentionMetadata

MAX_SPLITS = 16
E4M3_CAPABILITY = (8, 9)  # the first CUDA capability whose Triton converts float8 e4m3
PREFILL_WARPS = 8  # with Triton's default 4, the prefill kernel spills registers on sm_80 (scripts/compile_kernels.py)
PREFILL_STAGES, TRITON_STAGES = 5, 3  # `_prefill_stages`; Triton's default
# The decode over an FP8 cache asks for each key tile two iterations ahead: its registers already
# hold a multiprocessor to 2-3 blocks, so the second buffer (40 KB a block, under every GPU's 48 KB
# without opt-in) costs no occupancy and doubles the bytes in flight (docs/results/kernels-compiled.md).
# Over a bf16 cache the second buffer would cost blocks (5 -> 3 on sm_90), so it keeps Triton's 3.
FP8_DECODE_STAGES = 5


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(self, block_m: int | None = None, block_n: int = 64, num_splits: int | None = None,
                 sms: int | None = None, prefill_warps: int = PREFILL_WARPS, capability: tuple[int, int] | None = None,
                 prefill_stages: int | None = None, shared_bytes: int | None = None,
                 decode_stages: int | None = None):
        """`num_splits`: decode splits over the context; None chooses them per step so the decode
        programs fill the device's `sms` multiprocessors (read from a CUDA device when None; on
        another device, 1 split). `block_m`, `block_n`, `prefill_warps`: the prefill's tiles and
        warps (scripts/bench_attention.py compares them; block_m None: `_prefill_tiles` chooses).
        `capability`: the CUDA compute capability the kernels are built for (None: the device's;
        (0, 0) off CUDA); from sm_89 they widen an FP8 cache's codes with the GPU's e4m3
        conversion (the interpreter has it too). `prefill_stages`: the prefill loop's software
        pipelining stages (None: `_prefill_stages` chooses, within `shared_bytes`, the shared
        memory a block may have: None reads the device's). `decode_stages`: the decode loop's
        (None: FP8_DECODE_STAGES over an FP8 cache, else Triton's 3; bench_attention.py times both)."""
        self.block_m, self.block_n, self.num_splits, self.sms = block_m, block_n, num_splits, sms
        self.prefill_warps, self.capability = prefill_warps, capability
        self.prefill_stages, self.shared_bytes = prefill_stages, shared_bytes
        self.decode_stages = decode_stages

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, window: int | None = None,
                scale: float | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
        out = torch.empty_like(q)
        scoring = Scoring(scale, softcap, sinks)
        if meta.num_decodes:
            self.decode(q, kv_cache, meta, out, window, scoring, kv_scale)
        if meta.num_seqs > meta.num_decodes:
            self.attend_prefills(q, k, v, kv_cache, meta, out, window, scoring, kv_scale)
        return out

    def attend_prefills(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor,
                        window: int | None = None, scoring: Scoring = Scoring(),
                        kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
        self.prefill(q, kv_cache, meta, out, window, scoring, kv_scale)

    def decode(self, q, kv_cache, meta: AttentionMetadata, out: torch.Tensor, window: int | None = None,
               scoring: Scoring = Scoring(), kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
        n, heads, head_dim = meta.num_decodes, q.shape[1], q.shape[2]
        kv_heads, block_size, fp8 = kv_cache.shape[3], kv_cache.shape[2], fp8_kv.holds_codes(kv_cache)
        # over an FP8 cache, heads over 128 dims take key tiles half as long (whole ones spill on sm_80)
        block_n = max(16, self.block_n // 2) if fp8 and head_dim > 128 else self.block_n
        keys = min(max(meta.context_lens_list[:n]), window or max(meta.context_lens_list[:n]))
        splits = self._splits(n * kv_heads, triton.cdiv(keys, block_n) + (window is not None), q.device)
        group, block_d, native = heads // kv_heads, _block_d(head_dim), self._capability(q.device) >= E4M3_CAPABILITY
        part_acc = part_ml = out  # unused with one split
        if splits > 1:
            part_acc = torch.empty((splits, n, heads, block_d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((splits, n, heads, 2), dtype=torch.float32, device=q.device)
        kernels.paged_decode_kernel[(n, kv_heads, splits)](
            q, kv_cache, meta.block_tables, meta.context_lens, out, part_acc, part_ml, _sinks(scoring, out),
            q.stride(0), q.stride(1), meta.block_tables.stride(0), *_cache_strides(kv_cache),
            out.stride(0), out.stride(1), heads, *_scales(scoring, head_dim, fp8, native, kv_scale, window),
            GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=splits, PRECISION=_precision(q),
            SOFTCAP=scoring.softcap is not None, SINKS=scoring.sinks is not None, FP8_KV=fp8, NATIVE_FP8=native,
            num_stages=self.decode_stages or (FP8_DECODE_STAGES if fp8 else TRITON_STAGES))
        if splits > 1:
            kernels.merge_splits_kernel[(n, heads)](
                part_acc, part_ml, _sinks(scoring, out), out, n, heads, out.stride(0), out.stride(1), NUM_SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
                SINKS=scoring.sinks is not None)

    def prefill(self, q, kv_cache, meta: AttentionMetadata, out: torch.Tensor, window: int | None = None,
                scoring: Scoring = Scoring(), kv_scale: tuple[float, float] = (1.0, 1.0),
                end: int | None = None) -> None:
        """The prefill chunks of sequences num_decodes .. `end` (None: the last)."""
        first, heads, head_dim = meta.num_decodes, q.shape[1], q.shape[2]
        end = meta.num_seqs if end is None else end
        kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        longest = meta.longest_query(first, end)
        fp8, capability = fp8_kv.holds_codes(kv_cache), self._capability(q.device)
        native = capability >= E4M3_CAPABILITY
        block_m, block_n = _prefill_tiles(self.block_m, self.block_n, head_dim, fp8, capability)
        stages = self.prefill_stages or _prefill_stages(block_m, block_n, _block_d(head_dim), q.element_size(),
                                                        kv_cache.element_size(), self._shared_bytes(q.device))
        grid = (end - first, heads, triton.cdiv(longest, block_m))
        kernels.paged_prefill_kernel[grid](
            q, kv_cache, meta.block_tables, meta.context_lens, meta.query_start_tensor, out, _sinks(scoring, out),
            first, q.stride(0), q.stride(1), meta.block_tables.stride(0), *_cache_strides(kv_cache),
            out.stride(0), out.stride(1), *_scales(scoring, head_dim, fp8, native, kv_scale, window),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim, SOFTCAP=scoring.softcap is not None,
            SINKS=scoring.sinks is not None, BLOCK_D=_block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_SIZE=block_size, PRECISION=_precision(q), FP8_KV=fp8, NATIVE_FP8=native,
            num_warps=self.prefill_warps, num_stages=stages)

    def _capability(self, device: torch.device) -> tuple[int, int]:
        if self.capability is None:
            self.capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
        return self.capability

    def _shared_bytes(self, device: torch.device) -> int | None:
        """The shared memory a block may have (opted in), as Triton checks a launch against it."""
        if self.shared_bytes is None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.shared_bytes = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
        return self.shared_bytes

    def _splits(self, programs: int, tiles: int, device: torch.device) -> int:
        """A power of two (each split count is a kernel variant: `split_counts` bounds them), at most
        the key tiles, enough for about two programs per multiprocessor. A fixed count is taken as
        given, unless there are fewer key tiles (a short context, a windowed layer): then it is the
        power of two a chosen count would be, so kernel_warm_up's fixed counts meet no other."""
        if self.num_splits is not None:
            if self.num_splits <= tiles:
                return self.num_splits
            wanted = tiles
        else:
            if self.sms is None and device.type == "cuda":
                self.sms = torch.cuda.get_device_properties(device).multi_processor_count
            wanted = 1 if self.sms is None else min(MAX_SPLITS, 2 * self.sms // programs, tiles)
        return 1 << (max(1, wanted).bit_length() - 1)


def split_counts() -> list[int]:
    """Every split count a decode may launch without a fixed `num_splits`."""
    return [1 << i for i in range(MAX_SPLITS.bit_length())]


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """k, v: [T, kv_heads, head_dim] into one layer's cache at `slot_mapping` (flat slots), as FP8
    codes where the cache holds them (quantized in the kernel, as `fp8_kv.quantize` does)."""
    head_dim = k.shape[2]
    kernels.store_kv_kernel[(k.shape[0], k.shape[1])](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0),
        kv_cache.stride(2), kv_cache.stride(3), 1.0 / kv_scale[0], 1.0 / kv_scale[1], HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), FP8_KV=fp8_kv.holds_codes(kv_cache))


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(K to V, block, slot within a block, kv head), in elements; head_dim is contiguous."""
    if kv_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _scales(scoring: Scoring, head_dim: int, fp8: bool, native: bool, kv_scale: tuple[float, float],
            window: int | None) -> tuple[float, float, int, float, float]:
    """The kernels' (scale, to_log2, window, softcap, v_scale). Widened FP8 codes are values times a
    unit (1 widened natively, 2**-8 by bit moves): the score scale takes K's scale over it, the
    output V's. to_log2 turns a kernel's scores into log2 units: the scale times log2(e), or
    log2(e) alone where a soft cap scales its scores itself."""
    unit = 1.0 if native or not fp8 else 2.0 ** -8
    scale = (scoring.scale or 1 / math.sqrt(head_dim)) * (kv_scale[0] / unit if fp8 else 1.0)
    if scale <= 0:
        raise ValueError(f"attention scale {scale} must be positive")
    to_log2 = kernels.LOG2E.value * (1.0 if scoring.softcap is not None else scale)
    return scale, to_log2, window or 0, scoring.softcap or 0.0, kv_scale[1] / unit if fp8 else 1.0


def _prefill_tiles(block_m: int | None, block_n: int, head_dim: int, fp8: bool,
                   capability: tuple[int, int]) -> tuple[int, int]:
    """(query rows, keys) of a prefill tile. Query rows (block_m None): 128 from sm_90 for heads up
    to 128 dims over a cache of the serving dtype (two warp groups of 64; a key tile then issues
    half the instructions a FLOP that 64 rows do: scripts/compile_kernels.py's loops), else 64,
    and 32 over an FP8 cache with heads over 128 dims. Key tiles half as long for heads over 128
    dims (Gemma's 256). With more, the kernel spills registers: 128 rows on sm_80 and with
    256-dim heads, 64 over an FP8 cache with them, whole key tiles of 256 dims on sm_90; over an
    FP8 cache 128 rows take 254 registers on sm_90, the edge (scripts/compile_kernels.py
    --arch 80; --shape gemma2-9b; --kv-cache-dtype fp8)."""
    if block_m is None:
        block_m = 128 if capability >= (9, 0) and head_dim <= 128 and not fp8 else 64
        block_m //= 2 if fp8 and head_dim > 128 else 1
    return block_m, (block_n if head_dim <= 128 else max(16, block_n // 2))


def _prefill_stages(block_m: int, block_n: int, block_d: int, q_bytes: int, cache_bytes: int,
                    shared_bytes: int | None) -> int:
    """Software pipelining stages for the prefill's key loop. A key tile's gather is two loads deep
    (its pages' block ids, then K and V at them), and Triton's pipeliner shares a loop's stages - 1
    between a chain's loads: with its default 3 each is one iteration ahead, so the K and V of a
    tile are asked for at the end of the iteration before and waited for at once, their latency
    exposed every tile (a copy slack of 0: scripts/sass_loops.py). With 5 they are asked for two
    iterations ahead and a whole tile's work hides each (slack 1), for a third K and V buffer in
    shared memory beside the query tile; where that does not fit a block's `shared_bytes`, 3. Off
    CUDA (`shared_bytes` None) Triton's interpreter has no stages."""
    wanted = prefill_shared_bytes(block_m, block_n, block_d, q_bytes, cache_bytes)
    return PREFILL_STAGES if shared_bytes is None or wanted <= shared_bytes else TRITON_STAGES


def prefill_shared_bytes(block_m: int, block_n: int, block_d: int, q_bytes: int, cache_bytes: int) -> int:
    """At least the shared memory the prefill takes at PREFILL_STAGES: the query tile, three key
    tiles' K, V and block ids, and 1 KiB for the compiler's own (scripts/compile_kernels.py compiles it)."""
    return block_m * block_d * q_bytes + (PREFILL_STAGES + 1) // 2 * block_n * (2 * block_d * cache_bytes + 4) + 1024


def _sinks(scoring: Scoring, out: torch.Tensor) -> torch.Tensor:
    """A kernel's `sinks_ptr`: the sinks' logits, or without them the output, which SINKS=False never
    reads there (a fresh tensor, so always 16-byte aligned: no variant of its own)."""
    return out if scoring.sinks is None else scoring.sinks


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision(q: torch.Tensor) -> str:
    """float32 stays exact (no TF32), as the oracle computes it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"
