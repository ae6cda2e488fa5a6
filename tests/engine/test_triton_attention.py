"""The Triton paged-attention kernels against the same from-scratch reference as the torch oracle
(tests/engine/test_attention.py), under Triton's interpreter on CPU, compiled on CUDA where it is
(the `kernels` mark: scripts/gpu_check.sh runs these there):
GQA ratios 1, 4 and 8, block sizes 16 and 32, ragged contexts, chunks with earlier context and
prefix-cache hits, decode split over the context and not, sliding windows, soft-capped scores,
attention sinks (the flash-attn backend leaving them to the Triton kernel), an FP8 cache (every
e4m3 code widened as torch reads it, by bit moves and by Triton's e4m3 conversion), float32 and
bfloat16; random batches over any block size and
head sizes to 256; and a tiny model's greedy output with the Triton backend equal to the torch
backend's, with either cache."""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.attention import AttentionMetadata, fp8_kv  # noqa: E402
from splitserve.engine.attention.base import write_kv  # noqa: E402
from splitserve.engine.attention.metadata import PAD_SLOT  # noqa: E402
from splitserve.engine.attention.triton_paged import (  # noqa: E402
    E4M3_CAPABILITY, PREFILL_STAGES, TRITON_STAGES, TritonPagedBackend, _prefill_stages, split_counts, store_kv)
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_attention import SINKS, build_case, check_case  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
check = functools.partial(check_case, device=DEVICE)
# small tiles keep the interpreter quick; the kernels take any multiple of 16
SMALL = {"block_m": 16, "block_n": 16}
GQA = [(4, 4), (8, 2), (16, 2)]  # ratios 1, 4, 8
# e4m3 conversion: in the interpreter, and on GPUs from sm_89 (an A100 has none)
HAS_E4M3 = DEVICE.type == "cpu" or torch.cuda.get_device_capability() >= E4M3_CAPABILITY
# the capabilities whose FP8 widening each runs: bit moves (sm_80), e4m3 conversion (sm_89)
WIDENINGS = [(8, 0), pytest.param(E4M3_CAPABILITY, marks=pytest.mark.skipif(not HAS_E4M3, reason="no e4m3 conversion"))]


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 3])
def test_decodes_of_ragged_contexts(heads, kv_heads, block_size, splits):
    check([(1, 1), (17, 1), (40, 1), (95, 1)], heads=heads, kv_heads=kv_heads, dim=32, block_size=block_size,
          backend=TritonPagedBackend(**SMALL, num_splits=splits))


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_fresh_prefills_and_chunks_with_earlier_context(heads, kv_heads, block_size):
    # (context, query): fresh prompts, a chunk at an offset, a prefix-cache hit (most of the context cached)
    check([(5, 5), (37, 37), (50, 19), (70, 3)], heads=heads, kv_heads=kv_heads, dim=32,
          block_size=block_size, num_decodes=0, backend=TritonPagedBackend(**SMALL))


def test_decodes_and_chunks_in_one_batch_with_padded_tables():
    check([(33, 1), (2, 1), (64, 1), (20, 5), (48, 48), (40, 17)], heads=8, kv_heads=2, dim=64, block_size=16,
          extra_blocks=2, backend=TritonPagedBackend(**SMALL, num_splits=2))


@pytest.mark.parametrize("dim", [24, 160])  # not powers of two; over 128, the prefill's key tiles are halved
def test_head_dims_that_are_not_powers_of_two(dim):
    check([(30, 1), (21, 21), (45, 9)], heads=4, kv_heads=2, dim=dim, block_size=16,
          backend=TritonPagedBackend(block_m=16, block_n=32, num_splits=2))


HALF = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]  # the interpreter's bf16 dot is wrong


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("splits", [1, 4])
def test_half_precision(dtype, splits):
    check([(9, 1), (77, 1), (31, 31), (60, 12)], heads=8, kv_heads=1, dim=64, block_size=32,
          dtype=dtype, tolerance=2e-2, backend=TritonPagedBackend(**SMALL, num_splits=splits))


@pytest.mark.parametrize("window", [1, 10, 24, 70])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_sliding_window(window, splits):
    """Key tiles wholly before the window are skipped (the splits divide the rest); a window
    starting mid-tile, shorter than a tile, and rows of a query tile whose first key tile has
    none of their keys."""
    check([(9, 1), (77, 1), (40, 1), (31, 31), (60, 12), (90, 40)], heads=8, kv_heads=2, dim=32, block_size=16,
          num_decodes=3, backend=TritonPagedBackend(**SMALL, num_splits=splits), window=window)


@pytest.mark.parametrize("splits", [1, 3])
def test_scores_scaled_and_soft_capped(splits):
    check([(9, 1), (77, 1), (31, 31), (60, 12)], heads=8, kv_heads=2, dim=32, block_size=16, num_decodes=2,
          backend=TritonPagedBackend(**SMALL, num_splits=splits), window=24, scale=0.2, softcap=2.0)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_sinks(window, splits):
    """GPT-OSS's sinks, one (+8) outweighing short contexts' keys, GQA groups of 4: decodes (with
    splits, the sinks join at the merge; the short context leaves a split with no keys), fresh
    prompts, chunks with earlier context, a window starting mid-tile."""
    check([(9, 1), (77, 1), (40, 1), (31, 31), (60, 12), (90, 40)], heads=8, kv_heads=2, dim=32, block_size=16,
          num_decodes=3, backend=TritonPagedBackend(**SMALL, num_splits=splits), window=window, sinks=SINKS)


def test_sinks_in_half_precision_and_the_flash_attn_backend(monkeypatch):
    """flash-attn 2 has no sinks: fresh half-precision prompts, which it would take, go to the
    Triton kernel. GQA groups of 8, split decodes."""
    from splitserve.engine.attention import cuda

    monkeypatch.setattr(cuda, "flash_attn_varlen_func", lambda *args, **kwargs: pytest.fail("flash-attn ran"))
    check([(77, 1), (9, 1), (31, 31), (5, 5)], heads=16, kv_heads=2, dim=32, block_size=16, num_decodes=2,
          dtype=torch.float16, tolerance=2e-2, backend=cuda.FlashAttnBackend(**SMALL, num_splits=4), sinks=SINKS * 2)


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("capability", WIDENINGS)
def test_an_fp8_cache(heads, kv_heads, splits, capability):
    """e4m3 codes widened in the kernels (by bit moves, or the GPU's conversion), times the scales,
    equal torch's float8_e4m3fn values times them: decodes split and not, fresh prompts, a chunk with
    earlier context, a prefix hit, block size 32."""
    check([(9, 1), (77, 1), (40, 1), (31, 31), (50, 19), (70, 3)], heads=heads, kv_heads=kv_heads, dim=32,
          block_size=32, num_decodes=3, backend=TritonPagedBackend(**SMALL, num_splits=splits, capability=capability),
          kv_scale=(0.05, 3.0))


@pytest.mark.parametrize("dtype", HALF)
def test_an_fp8_cache_in_half_precision(dtype):
    """Fresh half-precision prompts over an FP8 cache, a window, GQA groups of 8, split decodes."""
    check([(77, 1), (9, 1), (31, 31), (5, 5)], heads=16, kv_heads=2, dim=32, block_size=16, num_decodes=2,
          dtype=dtype, tolerance=2e-2, backend=TritonPagedBackend(**SMALL, num_splits=4), window=40,
          kv_scale=(1.0, 1.0))


@pytest.mark.parametrize("capability", WIDENINGS)
def test_every_e4m3_code_widens_to_torchs_value(capability):
    """All 254 finite codes (the NaNs 0x7f, 0xff aside): the kernels' bit moves, and Triton's e4m3
    conversion, against torch's float8_e4m3fn, with a scale of 1, so the decode's output row is the
    one value each."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    kv_cache = torch.zeros((2, len(codes), 16, 1, 16), dtype=torch.uint8)
    kv_cache[:, :, 0, 0, 0] = codes  # each code the only key and value of a one-token context
    n = len(codes)
    meta = AttentionMetadata(torch.full((n,), PAD_SLOT, device=DEVICE), torch.arange(n, device=DEVICE)[:, None],
                             torch.ones(n, dtype=torch.long, device=DEVICE), list(range(n + 1)), [1] * n, n,
                             query_start_tensor=torch.arange(n + 1, device=DEVICE))
    q = torch.zeros((n, 1, 16), device=DEVICE)
    out = TritonPagedBackend(**SMALL, num_splits=1, capability=capability).forward(q, q, q, kv_cache.to(DEVICE),
                                                                                 meta)
    assert torch.equal(out[:, 0, 0].cpu(), values)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_the_fp8_store_rounds_as_torch(scale):
    """The store's integer rounding to e4m3 against torch's float8_e4m3fn conversion (`write_kv`):
    every code's value, the midpoints between neighbours (ties to even) and a float32 ulp either
    side, subnormals, zeros of both signs, values past 448, infinities, NaN (e4m3's NaN, not 448), and
    random ones over 2**-12 .. 2**10."""
    grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    special = torch.tensor([0.0, -0.0, -1e-9, 1e-9, 447.0, 449.0, 464.0, 500.0, -1e6, 2.0 ** -10, 3 * 2.0 ** -10,
                            float("inf"), float("nan")])
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.empty(1500).uniform_(-12, 10, generator=g)) * torch.randn(1500, generator=g).sign()
    values = torch.cat((grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e3)), special,
                        rand)) * scale
    values = torch.cat((values, -values))
    values = torch.cat((values, torch.zeros(-len(values) % 128))).view(-1, 1, 128)
    slots = torch.arange(len(values))
    caches = [torch.zeros((2, len(values), 1, 1, 128), dtype=torch.uint8, device=d) for d in ("cpu", DEVICE)]
    write_kv(values, values.flip(0), caches[0], slots, (scale, scale))
    store_kv(values.to(DEVICE), values.flip(0).to(DEVICE), caches[1], slots.to(DEVICE), (scale, scale))
    got, want = caches[1].cpu(), caches[0]
    wrong = (got != want).nonzero().tolist()  # [k or v, token, 0, 0, column]
    inputs = [(values if kv == 0 else values.flip(0))[t, 0, c].item() for kv, t, _, _, c in wrong[:8]]
    # torch's code of each value alone too: a tensor of one converts outside CPU torch's vector loops
    alone = [fp8_kv.quantize(torch.tensor([x]), scale).item() for x in inputs]
    assert not wrong, f"{len(wrong)} codes differ; input, kernel's, torch's, torch's of it alone: " + ", ".join(
        f"{x!r} {got[i].item():#04x} {want[i].item():#04x} {a:#04x}" for x, i, a in zip(inputs, map(tuple, wrong),
                                                                                          alone))


def test_a_chosen_split_count_is_the_largest_power_of_two_within_its_bounds():
    """Two programs per multiprocessor at most, MAX_SPLITS, the key tiles; a power of two, so that
    there are few kernel variants (`split_counts`) for kernel_warm_up to compile."""
    backend, cpu = TritonPagedBackend(sms=132), torch.device("cpu")
    for programs in range(1, 2100, 7):
        for tiles in (1, 3, 9, 40, 5000):
            splits, bound = backend._splits(programs, tiles, cpu), max(1, min(16, 264 // programs, tiles))
            assert splits in split_counts() and splits <= bound < 2 * splits
    assert split_counts() == [1, 2, 4, 8, 16]
    assert TritonPagedBackend()._splits(8, 100, cpu) == 1  # no multiprocessor count off CUDA
    assert TritonPagedBackend(num_splits=3)._splits(8, 100, cpu) == 3  # a fixed count as given
    assert TritonPagedBackend(num_splits=16)._splits(8, 3, cpu) == 2  # past the key tiles: as chosen


def test_the_prefill_pipelines_two_key_tiles_ahead_where_a_block_has_the_shared_memory():
    """Llama's 128 x 64 tiles of 128-dim heads: 130 KiB, within an H100's 227 KiB a block, not an
    L40S's 99; over an FP8 cache 66 KiB, within both. Gemma's 64 x 32 tiles of 256 dims: 129 KiB,
    within an A100's 163. Off CUDA (no limit) the interpreter ignores stages."""
    h100, a100, l40s = 227 * 1024, 163 * 1024, 99 * 1024
    assert (PREFILL_STAGES, TRITON_STAGES) == (5, 3)
    assert _prefill_stages(128, 64, 128, 2, 2, h100) == PREFILL_STAGES
    assert _prefill_stages(128, 64, 128, 2, 2, l40s) == TRITON_STAGES
    assert _prefill_stages(64, 64, 128, 2, 1, l40s) == PREFILL_STAGES
    assert _prefill_stages(64, 32, 256, 2, 2, a100) == PREFILL_STAGES
    assert _prefill_stages(64, 32, 256, 2, 2, l40s) == TRITON_STAGES
    assert _prefill_stages(128, 128, 256, 2, 2, None) == PREFILL_STAGES


@pytest.mark.parametrize("seed", range(10))
def test_random_batches(seed):
    """Random mixes of decodes, fresh prompts, chunks and prefix hits (one new token over a long
    context) over random shapes: head sizes to 256, any block size (a key's block is its position //
    the block size: 8 to 64 here, not only powers of two), tile sizes, split counts, a window, soft
    caps, sinks, an FP8 cache (either widening), half precision, the decode at 3 or 5 stages
    (compiled, on a GPU)."""
    rng = random.Random(2000 + seed)
    heads, kv_heads = rng.choice(GQA + [(8, 1), (8, 8)])
    decodes = [(rng.randint(1, 150), 1) for _ in range(rng.randint(0, 4))]
    contexts = [rng.randint(1, 150) for _ in range(rng.randint(1, 3))]
    prefills = [(c, rng.choice([c, rng.randint(1, c), 1])) for c in contexts]
    options = {"window": rng.randint(1, 100), "softcap": 30.0, "sinks": (SINKS * 2)[:heads],
               "kv_scale": (0.37, 0.5), "dtype": torch.float16}
    chosen = {name: options[name] for name in rng.sample(sorted(options), rng.randint(0, 2))}
    check(decodes + prefills, heads=heads, kv_heads=kv_heads, dim=rng.choice([16, 24, 64, 128, 256]),
          block_size=rng.choice([8, 12, 16, 32, 64]), seed=seed, num_decodes=len(decodes), **chosen,
          tolerance=2e-2 if "dtype" in chosen else 1e-5, extra_blocks=rng.choice([0, 2]),
          backend=TritonPagedBackend(block_m=rng.choice([16, 32]), block_n=rng.choice([16, 32]),
                                     num_splits=rng.choice([None, 1, 2, 5]),
                                     capability=rng.choice([(8, 0), E4M3_CAPABILITY][:1 + HAS_E4M3]),
                                     decode_stages=rng.choice([None, 3, 5])))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_tiny_model_generates_the_same_greedy_tokens_with_either_backend(kv_cache_dtype):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[256] + list(range(40, 70)), [256, 72, 105], [256] + [7] * 50]
    engine_args = {"num_kv_blocks": 64, "max_model_len": 512, "chunk_token_budget": 32, "policy": "mixed",
                   "kv_cache_dtype": kv_cache_dtype}
    torch_out = LLM("demo", **engine_args).generate(prompts, params)
    triton_llm = LLM("demo", attention_backend="triton", **engine_args)
    assert triton_llm.engine.runner.backend.name == "triton"
    triton_out = triton_llm.generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]


def test_drafted_tokens_are_checked_alike_by_the_triton_kernels():
    """Speculative decoding's steps (a decode's token and its drafts as one chunk over its context)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[256] + list(range(40, 60)) * 2, [256] + [7] * 30]
    engine_args = {"num_kv_blocks": 64, "max_model_len": 512, "num_speculative_tokens": 3}
    torch_out = LLM("demo", **engine_args).generate(prompts, params)
    engine = LLMEngine("demo", attention_backend="triton", **engine_args)
    assert engine.runner.backend.name == "triton"
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    kept, outputs = 0, {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out.token_ids) for out in engine.step())
        kept += engine.last_step.accepted_tokens
    assert [outputs[str(i)] for i in range(len(prompts))] == [o.token_ids for o in torch_out] and kept > 0


def test_backend_choice(monkeypatch):
    from splitserve.engine.attention import TorchPagedBackend, select_backend
    from splitserve.engine.config import ConfigError

    cpu = torch.device("cpu")
    assert isinstance(select_backend(cpu), TorchPagedBackend) and isinstance(select_backend(cpu, "torch"),
                                                                             TorchPagedBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(select_backend(cpu, "triton"), TritonPagedBackend)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="needs CUDA"):
        select_backend(cpu, "triton")


def test_the_store_skips_padding_slots():
    torch.manual_seed(0)
    cache = torch.randn(2, 4, 16, 2, 32, device=DEVICE)
    k, v = torch.randn(3, 2, 32, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE)
    expected = cache.clone()
    write_kv(k[[0, 2]], v[[0, 2]], expected, torch.tensor([5, 20], device=DEVICE))
    store_kv(k, v, cache, torch.tensor([5, PAD_SLOT, 20], device=DEVICE))
    assert torch.equal(cache, expected)


def test_token_rows_past_two_to_the_31_elements_are_read_where_they_lie():
    """A step's q, k and v rows 2**30 elements apart (as Llama-3's fused QKV rows of 6,144 values lie
    past 2**31 elements from the 349,526th token on): the store addresses a token's row with an int64
    offset (the prefill's come from the step's int64 query starts), so the results equal a
    contiguous copy's, not a wrapped address's."""
    q, k, v, k_cache, v_cache, meta, _, _ = build_case([(20, 3)], 2, 1, 16, 16, 4, seed=0)
    q, k, v, kv_cache = (t.half() for t in (q, k, v, torch.stack((k_cache, v_cache))))
    meta = dataclasses.replace(meta, **{name: getattr(meta, name).to(DEVICE) for name in
                                        ("slot_mapping", "block_tables", "context_lens", "query_start_tensor")})
    # 4 GiB of half-precision values, 3 rows of q, k and v touched (on CPU the rest is never committed)
    buffer = torch.empty(2 ** 31 + 256, dtype=torch.half, device=DEVICE)
    far = [buffer[at:].as_strided(x.shape, (2 ** 30, *x.stride()[1:])) for at, x in ((0, q), (64, k), (128, v))]
    for view, x in zip(far, (q, k, v)):
        view.copy_(x)
    backend, near_cache = TritonPagedBackend(**SMALL), kv_cache.to(DEVICE)
    far_cache = near_cache.clone()
    near = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), near_cache, meta)
    assert torch.equal(backend.forward(*far, far_cache, meta), near) and torch.equal(far_cache, near_cache)
