"""The host KV tier on a real cache (`splitserve.engine.host_kv_blocks`): slots hold blocks bit for
bit; an engine whose small cache evicts a prompt's prefix finds it again in host memory and answers
as an engine that never evicted it does (one rank and tensor-parallel ranks); its settings' errors."""
from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine.config import ConfigError
from splitserve.engine import host_kv_blocks
from splitserve.engine.host_kv_blocks import HostKVBlocks, _runs
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_same, one_thread, run_engine  # noqa: F401  (fixture)
from tests.engine.tp_helpers import tp_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
SMALL = dict(num_kv_blocks=24, max_model_len=256)  # 384 token slots: each long prompt evicts the last
BLOCK_BYTES = 4 * 2 * 16 * 4 * 32 * 4  # the demo model's block: 4 layers, K and V, 16 tokens, 4 heads of 32, float32


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(160)]  # 10 blocks
    others = [[rng.randrange(256) for _ in range(240)] for _ in range(2)]
    return [shared + [1, 2, 3], *others, shared + [4, 5]]


PROMPTS = _prompts()


def run_in_turn(engine: LLMEngine) -> list:
    """Each prompt alone, one after another: the two long ones evict the first one's blocks."""
    return [run_engine(engine, {f"r{i}": (prompt, GREEDY)})[f"r{i}"] for i, prompt in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def reference() -> list:
    return run_in_turn(LLMEngine(num_kv_blocks=192, max_model_len=256))


@pytest.mark.parametrize("staged", [64, 2])
def test_slots_hold_blocks_bit_for_bit(monkeypatch, staged):
    """Copies of more blocks than a stage holds go a stage at a time."""
    monkeypatch.setattr(host_kv_blocks, "STAGED_BLOCKS", staged)
    engine = LLMEngine(**SMALL)
    data = engine.kv_cache.data
    data.copy_(torch.randn_like(data))
    before = data.clone()
    blocks = HostKVBlocks(engine.kv_cache, 6)
    blocks.save([3, 9, 4], [5, 0, 1])
    assert torch.equal(blocks.host[5], before[:, :, 3]) and torch.equal(blocks.host[0], before[:, :, 9])
    data.zero_()
    blocks.load([1, 5, 0], [20, 2, 7])
    assert torch.equal(data[:, :, 20], before[:, :, 4]) and torch.equal(data[:, :, 2], before[:, :, 3])
    assert torch.equal(data[:, :, 7], before[:, :, 9])
    assert data[:, :, [3, 9, 4]].abs().sum() == 0  # nothing else written


def test_runs_of_consecutive_slots():
    assert _runs([4, 5, 6, 0, 2, 3]) == [(0, 4, 3), (3, 0, 1), (4, 2, 2)]
    assert _runs([]) == []


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_evicted_prefix_comes_back_from_host_memory(reference, policy):
    engine = LLMEngine(**SMALL, kv_host_cache_bytes=48 * BLOCK_BYTES, kv_host_write_policy=policy)
    assert engine.host_tier.num_slots == 48 and engine.host_tier.write_through == (policy == "write_through")
    outputs = run_in_turn(engine)
    assert_same(outputs, reference)
    assert outputs[3].num_cached_tokens == 160  # every full block of the shared prefix
    assert engine.host_tier.restored_blocks >= 10
    without = run_in_turn(LLMEngine(**SMALL))
    assert without[3].num_cached_tokens == 0  # the small cache alone lost it
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_tensor_parallel_ranks_keep_their_heads(reference, policy):
    """Each rank saves (or writes) and restores its own heads (the leader's copies, fences and waits
    reach the other ranks as commands): the answer is the one-rank engine's."""
    with tp_engine("demo", 2, **SMALL, kv_host_cache_bytes=48 * BLOCK_BYTES // 2,
                   kv_host_write_policy=policy) as (engine, followers):
        assert engine.host_tier.num_slots == 48
        outputs = run_in_turn(engine)
        engine.check_integrity()
    assert not followers.errors
    assert outputs[3].num_cached_tokens == 160 and engine.host_tier.restored_blocks >= 10
    assert [out.token_ids for out in outputs] == [out.token_ids for out in reference]
    for out, ref in zip(outputs, reference):
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)


@pytest.mark.parametrize("overrides, match", [
    (dict(kv_host_cache_bytes=-1), "kv_host_cache_bytes must be >= 0"),
    (dict(kv_host_cache_bytes=BLOCK_BYTES, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_host_cache_bytes=BLOCK_BYTES - 1), "holds no KV block"),
    (dict(kv_host_cache_bytes=2**60), "bytes of host memory, but the host has"),
    (dict(kv_host_write_policy="write_around"), "kv_host_write_policy must be one of write_through, write_back"),
])
def test_settings_that_cannot_work_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        LLMEngine(**SMALL, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_on_cuda_the_copies_keep_their_order(policy):
    """Pinned slots; saves and restores on the compute stream, writes on a side stream fenced before
    a written block is reused: the small CUDA engine answers as a large CUDA engine does."""
    block_bytes = LLMEngine(**SMALL, device="cuda").kv_cache.block_bytes
    reference = run_in_turn(LLMEngine(num_kv_blocks=192, max_model_len=256, device="cuda"))
    engine = LLMEngine(**SMALL, device="cuda", kv_host_cache_bytes=48 * block_bytes, kv_host_write_policy=policy)
    outputs = run_in_turn(engine)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in reference]
    assert outputs[3].num_cached_tokens == 160 and engine.host_tier.restored_blocks >= 10
