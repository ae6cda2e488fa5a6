"""GPU paths against the CPU oracle. Skipped without CUDA (see tests/conftest.py)."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.attention.torch_paged import TorchPagedBackend
from splitserve.engine.attention.cuda import CudaBackend
from splitserve.engine.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.gpu


def test_cuda_greedy_matches_cpu():
    prompts = [[256] + list(range(1, n)) for n in (3, 40, 130, 700)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM("demo", device="cpu", chunk_token_budget=64).generate(prompts, params)
    gpu = LLM("demo", device="cuda", chunk_token_budget=64).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_cuda_backend_matches_torch_backend():
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 8, 2, 64, 16, 32
    lens = [(1, 37), (1, 5), (50, 50), (20, 70)]  # (query tokens, context): decodes, a fresh prefill, a chunk
    tables, slots, starts, next_block = [], [], [0], 0
    for n, ctx in lens:
        table = list(range(next_block, next_block + -(-ctx // bs)))
        next_block += len(table)
        tables.append(table + [0] * (8 - len(table)))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(torch.tensor(slots, device="cuda"), torch.tensor(tables, device="cuda"),
                             torch.tensor([c for _, c in lens], device="cuda"), starts, [c for _, c in lens], 2)
    q = torch.randn(starts[-1], heads, dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(starts[-1], kv_heads, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    cache = torch.randn(2, blocks, bs, kv_heads, dim, device="cuda", dtype=torch.float16)
    expected = TorchPagedBackend().forward(q, k, v, cache.clone(), meta)
    got = CudaBackend().forward(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
