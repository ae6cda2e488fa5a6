"""GPU paths against the CPU oracle. Skipped without CUDA (see tests/conftest.py)."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.attention.metadata import AttentionMetadata
from splitserve.engine.attention.torch_paged import TorchPagedBackend
from splitserve.engine.attention.triton_paged import TritonPagedBackend
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS, NEW_TOKENS, ckpt, generation_prompts, tokenizers_by_kind,
)

pytestmark = pytest.mark.gpu


def test_cuda_greedy_matches_cpu():
    prompts = [[256] + [i % 256 for i in range(1, n)] for n in (3, 40, 130, 700)]  # byte ids after the BOS
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM("demo", device="cpu", chunk_token_budget=64).generate(prompts, params)
    gpu = LLM("demo", device="cuda", chunk_token_budget=64).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_triton_backend_matches_torch_backend_compiled(dtype, splits):
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 8, 2, 64, 16, 32
    # (query tokens, context): decodes (300: five 64-key tiles, so 4 splits are 4), a fresh prefill, a chunk
    lens = [(1, 300), (1, 5), (50, 50), (20, 70)]
    width = max(-(-ctx // bs) for _, ctx in lens)
    tables, slots, starts, next_block = [], [], [0], 0
    for n, ctx in lens:
        table = list(range(next_block, next_block + -(-ctx // bs)))
        next_block += len(table)
        tables.append(table + [0] * (width - len(table)))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(torch.tensor(slots, device="cuda"), torch.tensor(tables, device="cuda"),
                             torch.tensor([c for _, c in lens], device="cuda"), starts, [c for _, c in lens], 2,
                             query_start_tensor=torch.tensor(starts, device="cuda"))
    q = torch.randn(starts[-1], heads, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(starts[-1], kv_heads, dim, device="cuda", dtype=dtype) for _ in range(2))
    cache = torch.randn(2, blocks, bs, kv_heads, dim, device="cuda", dtype=dtype)
    expected = TorchPagedBackend().forward(q, k, v, cache.clone(), meta)
    got = TritonPagedBackend(num_splits=splits).forward(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_each_architecture_on_cuda_generates_as_the_cpu_path(ckpt):
    """Every checkpoint kind (Qwen2's biases, Qwen3's head norms, tied heads, GQA) through the CUDA
    path (Triton kernels, decode graphs) in float32: the CPU path's greedy tokens, which
    test_model_vs_hf holds to transformers' (a GPU image's own transformers may be older: 5.17's
    gpt-oss and LongRoPE generate otherwise). Last in this file: a device run cut short loses it
    first (each checkpoint compiles its own shapes)."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

    def greedy(device: str) -> list[list[int]]:
        llm = LLM(path, dtype="float32", chunk_token_budget=16, max_num_seqs=8, **{**ENGINE_ARGS, "device": device})
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert greedy("cuda") == greedy("cpu")
