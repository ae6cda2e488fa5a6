"""Torch's built-in FlashAttention-2 for fresh prompts (`attention/torch_flash.py`), through the
flash-attn backend: the op's schema in the installed torch takes the arguments it is given; a
stand-in with the op's contract (torch's SDPA under a mask of each prompt's causal window) checks
what it is given and the backend's use of it against the reference (tests/engine/test_attention.py),
the Triton kernels beside it interpreted on CPU and compiled on a GPU (the `kernels` mark,
scripts/gpu_check.sh), where the op itself runs too."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.engine.attention import cuda, select_backend, torch_flash  # noqa: E402
from splitserve.engine.attention.base import Scoring  # noqa: E402
from tests.engine.test_attention import build_case, check_case  # noqa: E402

pytestmark = pytest.mark.kernels
CUDA = torch.device("cuda")
DEVICE = CUDA if torch.cuda.is_available() else torch.device("cpu")  # the Triton kernels compiled, or interpreted
SMALL = {"block_m": 16, "block_n": 16}  # the Triton kernel's tiles (decodes, and what the op does not take)


def test_the_installed_ops_schema_takes_the_arguments_given():
    schema = torch.ops.aten._flash_attention_forward.default._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert positional[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                               "is_causal", "return_debug_mask"]
    assert {"scale", "window_size_left", "window_size_right"} <= {a.name for a in schema.arguments if a.kwarg_only}
    assert schema.returns[0].name == "output"


def stand_in(calls, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
             window_size_left, window_size_right):
    """The op's contract on CPU: each prompt's queries attend to its keys from p - left to p + right."""
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert (dropout_p, is_causal, return_debug_mask, window_size_right) == (0.0, True, False, 0)
    bounds = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:])) and bounds[-1] == q.shape[0]
    calls.append((len(bounds) - 1, window_size_left))
    out = torch.empty_like(q)
    for lo, hi in zip(bounds, bounds[1:]):
        p = torch.arange(hi - lo, device=q.device)
        allowed = (p[None, :] <= p[:, None]) & ((window_size_left < 0) | (p[None, :] >= p[:, None] - window_size_left))
        out[lo:hi] = F.scaled_dot_product_attention(*(x[lo:hi].transpose(0, 1) for x in (q, k, v)), attn_mask=allowed,
                                                    scale=scale, enable_gqa=True).transpose(0, 1)
    return out, None, None, None, None


@pytest.fixture
def calls(monkeypatch):
    """The backend on CPU with torch's kernel (the stand-in), flash-attn's package absent."""
    made = []
    monkeypatch.setattr(cuda, "flash_attn_varlen_func", None)
    monkeypatch.setattr(torch_flash, "runs_on", lambda device: True)
    monkeypatch.setattr(torch_flash, "_forward", functools.partial(stand_in, made))
    return made


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("window", [None, 10])
def test_fresh_prompts_take_torchs_kernel(calls, heads, kv_heads, window):
    """Decodes beside fresh prompts (the prompts' tokens after the decodes'), GQA ratios 1, 4, 8, a
    window starting mid-prompt and one longer than a prompt."""
    backend = select_backend(CUDA, "auto")
    assert isinstance(backend, cuda.FlashAttnBackend) and backend.fresh is torch_flash
    check_case([(40, 1), (9, 1), (31, 31), (5, 5), (24, 24)], heads=heads, kv_heads=kv_heads, dim=32, block_size=16,
               num_decodes=2, dtype=torch.float16, tolerance=2e-2, window=window, scale=0.3,
               device=DEVICE, backend=cuda.FlashAttnBackend(**SMALL, num_splits=2))
    assert calls == [(3, -1 if window is None else window - 1)]


@pytest.mark.parametrize("seqs,fresh_at_end", [
    ([(50, 19), (70, 3), (31, 31), (5, 5)], 2),  # as the runner orders them: chunks with earlier context first
    ([(31, 31), (50, 19), (5, 5), (24, 24)], 2),  # a fresh prompt before a chunk: the Triton kernel's
])
def test_chunks_before_the_fresh_prompts_take_triton(calls, seqs, fresh_at_end):
    """In one step with decodes: the chunks with earlier context (a chunk at an offset, a prefix hit),
    and whatever comes before the last of them, through the Triton kernel; the fresh prompts after
    it through torch's, in one call."""
    check_case([(40, 1), (9, 1)] + seqs, heads=8, kv_heads=2, dim=32, block_size=16, num_decodes=2,
               dtype=torch.float16, tolerance=2e-2, device=DEVICE, backend=cuda.FlashAttnBackend(**SMALL, num_splits=2))
    assert calls == [(fresh_at_end, -1)]


@pytest.mark.parametrize("seqs,num_decodes,first,offsets,longest", [
    ([(40, 1), (50, 19), (31, 31), (5, 5)], 1, 2, [0, 31, 36], 31),
    ([(40, 1), (9, 1)], 2, 2, [0], 0),  # decodes alone: none
    ([(31, 31), (50, 19)], 0, 2, [0], 0),  # a chunk last: none
    ([(7, 7), (12, 12)], 0, 0, [0, 7, 19], 12),  # fresh prompts alone
])
def test_the_step_finds_its_fresh_prompts_once(seqs, num_decodes, first, offsets, longest):
    """Where the fresh prompts at the batch's end begin, their offsets and longest length: worked
    out once per step (the metadata keeps them), not in every layer."""
    meta = build_case(seqs, 2, 1, 8, 16, 64, seed=0, num_decodes=num_decodes)[5]
    assert (meta.fresh_from, meta.fresh_query_starts.tolist(), meta.fresh_longest) == (first, offsets, longest)
    assert meta.fresh_query_starts.dtype == torch.int32 and meta.fresh_query_starts is meta.fresh_query_starts


def test_over_an_fp8_cache_it_reads_what_the_cache_gives_back(calls):
    """The fresh prompts' keys and values as their codes stand for them, scales that saturate some
    (the reference attends to what the codes stand for); a chunk before them, through Triton's."""
    check_case([(40, 1), (50, 19), (31, 31), (24, 24)], heads=8, kv_heads=2, dim=32, block_size=16, num_decodes=1,
               dtype=torch.float16, tolerance=2e-2, kv_scale=(0.004, 0.01),
               device=DEVICE, backend=cuda.FlashAttnBackend(**SMALL, num_splits=2))
    assert calls == [(2, -1)]


@pytest.mark.parametrize("case", ["chunk", "softcap", "odd head size", "float32"])
def test_what_it_does_not_take_goes_to_triton(calls, case):
    """A chunk with earlier context last, a soft cap (which torch's kernel lacks), a head size that is
    not a multiple of 8, float32: the Triton kernel's, against the same reference."""
    seqs = [(9, 1), (31, 31), (50, 19) if case == "chunk" else (24, 24)]
    dim = 20 if case == "odd head size" else 32
    dtype, tolerance = (torch.float32, 1e-5) if case == "float32" else (torch.float16, 2e-2)
    check_case(seqs, heads=8, kv_heads=2, dim=dim, block_size=16, num_decodes=1, dtype=dtype, tolerance=tolerance,
               softcap=2.0 if case == "softcap" else None, device=DEVICE, backend=cuda.FlashAttnBackend(**SMALL))
    assert calls == []


def test_takes():
    half = torch.empty(3, 4, 128, dtype=torch.bfloat16)
    assert torch_flash.takes(half, Scoring())
    assert torch_flash.takes(torch.empty(3, 4, 256, dtype=torch.float16), Scoring(scale=0.1))
    assert not torch_flash.takes(half, Scoring(softcap=30.0))
    assert not torch_flash.takes(half.float(), Scoring())
    assert not torch_flash.takes(torch.empty(3, 4, 264, dtype=torch.bfloat16), Scoring())
    assert not torch_flash.takes(torch.empty(3, 4, 20, dtype=torch.bfloat16), Scoring())


def test_without_either_kernel_flash_attn_is_refused_and_auto_takes_triton(monkeypatch):
    from splitserve.engine.attention.triton_paged import TritonPagedBackend
    from splitserve.engine.config import ConfigError

    monkeypatch.setattr(cuda, "flash_attn_varlen_func", None)
    assert not torch_flash.runs_on(torch.device("cpu"))
    monkeypatch.setattr(torch_flash, "runs_on", lambda device: False)
    with pytest.raises(ConfigError, match="flash-attn package .* or a CUDA build of torch"):
        cuda.FlashAttnBackend()
    assert type(select_backend(CUDA, "auto")) is TritonPagedBackend


@pytest.mark.skipif(not torch_flash.runs_on(CUDA), reason="torch's FlashAttention-2 needs an sm_80 to sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 40])
def test_torchs_kernel_on_the_gpu(monkeypatch, dtype, window):
    """The op itself: fresh prompts up to 300 tokens, GQA groups of 4, 128-dim heads, beside decodes."""
    monkeypatch.setattr(cuda, "flash_attn_varlen_func", None)
    check_case([(90, 1), (300, 300), (77, 77), (5, 5)], heads=16, kv_heads=4, dim=128, block_size=16, num_decodes=1,
               dtype=dtype, tolerance=2e-2, window=window, device="cuda", backend=cuda.FlashAttnBackend(CUDA))
