"""A tensor-parallel engine (TP 2 and 4 on threads, gloo, float32) against the same model on one
rank, on checkpoints written by transformers: shards read from safetensors, logits within 1e-4,
identical greedy output; a rank that stops stepping breaks the worker."""
from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.llm_engine import LLMEngine, StepFailed
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.engine.tensor_parallel import TPError
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture, module-wide)
from tests.engine.hf_checkpoints import ENGINE_ARGS, prompt_ids, tokenizers_by_kind, write_checkpoint  # noqa: F401
from tests.engine.test_fp8 import quantize_checkpoint
from tests.engine.test_mxfp4 import quantize_experts
from tests.engine.tp_helpers import tp_engine

ARGS = dict(ENGINE_ARGS, dtype="float32")
TOL = 1e-4
SCORED = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizers_by_kind):  # noqa: F811
    root = tmp_path_factory.mktemp("tp")
    names = ("llama_mha", "llama3_gqa_tied", "qwen2_bias", "llama_head_dim", "qwen3_qk_norm", "phi3_fused_partial",
             "phi3_longrope", "mixtral_moe", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "gpt_oss", "granite",
             "olmo2", "olmo3", "smollm3", "exaone4", "ministral3", "glm4_moe", "glm4", "cohere",
             "cohere2", "helium", "seed_oss", "ernie4_5", "ernie4_5_moe", "minimax_m2", "hunyuan_dense",
             "granite4_dense", "internlm3", "arcee", "apertus", "cohere_qk_norm", "nemotron")
    for name in names:
        write_checkpoint(root / name, name, tokenizers_by_kind)
    write_checkpoint(root / "gpt_oss_mxfp4", "gpt_oss", tokenizers_by_kind)
    quantize_experts(root / "gpt_oss_mxfp4", width=96, scale_shift=-5)  # 3 groups: 2 ranks hold 64 and 32
    write_checkpoint(root / "qwen3_moe_fp8", "qwen3_moe", tokenizers_by_kind)
    quantize_checkpoint(root / "qwen3_moe_fp8")  # each rank dequantizes a whole weight, then keeps its part
    return {name: str(root / name) for name in names + ("gpt_oss_mxfp4", "qwen3_moe_fp8")}


def prompts(vocab: int) -> list[list[int]]:
    return [prompt_ids(seed, length, vocab) for seed, length in ((1, 37), (2, 5), (3, 70))]


def run(engine: LLMEngine, ids: list[list[int]]):
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, SCORED)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(ids))]


def last_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The raw logits after the whole prompt, computed afresh (no prefix-cache hit)."""
    seq = Sequence("logits", list(prompt), SamplingParams(max_tokens=1))
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    plan = Plan((ScheduledSeq(seq, len(prompt)),))
    logits = engine.runner.execute(plan, {"logits": engine.block_manager.block_tables("logits")}).logits
    engine.block_manager.free("logits")
    return logits


def assert_close_outputs(ours, reference) -> None:
    for got, want in zip(ours, reference):
        assert got.token_ids == want.token_ids
        for g, w in zip(got.prompt_logprobs[1:] + got.outputs[0].logprobs,
                        want.prompt_logprobs[1:] + want.outputs[0].logprobs):
            assert g.keys() == w.keys()
            assert max(abs(g[k] - w[k]) for k in g) < TOL


@pytest.mark.parametrize("name, size", [("llama_mha", 2), ("llama3_gqa_tied", 2), ("qwen2_bias", 2),
                                        ("llama_head_dim", 2), ("qwen3_qk_norm", 2), ("llama3_gqa_tied", 4),
                                        ("llama_mha", 4), ("phi3_fused_partial", 4), ("phi3_longrope", 2),
                                        ("mixtral_moe", 2), ("qwen3_moe", 4), ("qwen2_moe", 2), ("gemma2", 2),
                                        ("gemma3", 2), ("gpt_oss", 2), ("gpt_oss_mxfp4", 2),
                                        ("qwen3_moe_fp8", 2), ("granite", 2), ("olmo2", 2), ("olmo2", 4),
                                        ("olmo3", 2), ("smollm3", 2), ("exaone4", 4),
                                        ("ministral3", 2), ("glm4_moe", 2),
                                        ("glm4", 2), ("cohere", 2), ("cohere2", 2), ("helium", 2),
                                        ("seed_oss", 2), ("ernie4_5", 2), ("ernie4_5_moe", 2), ("minimax_m2", 2),
                                        ("minimax_m2", 4), ("hunyuan_dense", 2), ("granite4_dense", 2),
                                        ("internlm3", 2), ("arcee", 2), ("apertus", 2), ("cohere_qk_norm", 4),
                                        ("nemotron", 2)])
def test_tp_matches_one_rank(checkpoints, name, size):
    """Logits, prompt logprobs and greedy tokens of TP `size` equal one rank's; with 2 KV heads
    and 4 ranks each KV head is replicated on two ranks (OLMo's k norm, across heads, counts each
    once); each rank of an MoE model holds a slice of every expert (of MXFP4 ones, whole groups:
    slices of unequal widths)."""
    path = checkpoints[name]
    single = LLMEngine(path, **ARGS)
    ids = prompts(single.model_config.vocab_size)
    reference, reference_logits = run(single, ids), last_logits(single, ids[0])
    with tp_engine(path, size, **ARGS) as (engine, followers):
        assert engine.kv_cache.data.shape[-2] == max(1, single.model_config.num_key_value_heads // size)
        ours, logits = run(engine, ids), last_logits(engine, ids[0])
        engine.check_integrity()
    assert not followers.errors
    assert (logits - reference_logits).abs().max().item() < TOL
    assert_close_outputs(ours, reference)


def test_ranks_agree_on_the_fewest_blocks(checkpoints):
    """Each rank sizes its cache from its own budget; all take the smallest."""
    block_bytes = 2 * 3 * 2 * 16 * 8 * 4  # K and V, 3 layers, 2 of 4 KV heads, head_dim 16, 8 tokens, float32
    args = {**ARGS, "num_kv_blocks": None, "kv_cache_memory_bytes": 48 * block_bytes}
    with tp_engine(checkpoints["llama_mha"], 2, follower_overrides={"kv_cache_memory_bytes": 40 * block_bytes},
                   **args) as (engine, followers):
        assert engine.kv_cache.num_blocks == engine.block_manager.num_blocks == 40
        assert followers.followers[1].kv_cache.num_blocks == 40
    assert not followers.errors


@pytest.mark.parametrize("size, field", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_unshardable_sizes_name_the_field(checkpoints, size, field):
    from splitserve.engine.model.sharding import check_shardable

    with pytest.raises(ConfigError, match=field):
        check_shardable(LLMEngine(checkpoints["llama_mha"], **ARGS).model_config, size)


def test_an_unshardable_expert_width_names_the_field(checkpoints):
    from dataclasses import replace

    from splitserve.engine.model.sharding import check_shardable

    config = LLMEngine(checkpoints["qwen3_moe"], **ARGS).model_config
    check_shardable(config, 4)
    with pytest.raises(ConfigError, match="moe_intermediate_size=30"):
        check_shardable(replace(config, moe_intermediate_size=30), 4)


def test_a_rank_that_stops_breaks_the_worker(checkpoints):
    """A follower that leaves mid-round fails the leader's step (after the group's timeout), and
    the engine reports itself unsound instead of stepping out of step again."""
    path = checkpoints["llama_mha"]

    def leave_on_command(follower):
        def on_command(command):
            raise RuntimeError(f"follower gives up on {command!r}")
        follower.on_command = on_command

    with tp_engine(path, 2, timeout=2.0, setup=leave_on_command, **ARGS) as (engine, followers):
        engine.add_request("a", prompt_ids(1, 9, engine.model_config.vocab_size), SCORED)
        engine.tp_leader.post(1, "stop-now")
        with pytest.raises(StepFailed) as failure:
            engine.step()
        assert isinstance(failure.value.cause, TPError)
        with pytest.raises(RuntimeError, match="tensor-parallel group of 2 ranks is broken"):
            engine.check_integrity()
    assert "follower gives up" in str(followers.errors[1])
