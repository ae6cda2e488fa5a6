"""A model whose every layer slides (Mistral's layout) keeps only a window's KV blocks per sequence:
long generations in a cache far too small for their whole tables still match transformers, with
no preemption, and each sequence's released blocks are exactly those out of every later query's
reach."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS, generation_prompts, hf_greedy, tokenizers_by_kind, write_checkpoint,
)

NEW = 40
BLOCKS = 32  # the six sequences' whole tables would take 60 blocks of 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizers_by_kind):
    path = tmp_path_factory.mktemp("mistral_window")
    return str(path), write_checkpoint(path, "mistral_window", tokenizers_by_kind)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_long_generations_in_a_small_cache_match_hf(mistral, policy):
    path, hf = mistral
    window, size = hf.config.sliding_window, ENGINE_ARGS["block_size"]
    prompts = generation_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    engine = LLMEngine(path, **{**ENGINE_ARGS, "num_kv_blocks": BLOCKS}, policy=policy, chunk_token_budget=16,
                       prompt_token_budget=48, dtype="float32", max_model_len=128)
    assert engine.block_manager.windows == (window,) and engine.block_manager.num_blocks == BLOCKS - 1
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done, bm = {}, engine.block_manager
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
        engine.check_integrity()
        for seq in engine.policy.running:
            reach, table = max(0, seq.num_computed_tokens - window + 1) // size, bm.block_table(seq.seq_id)
            assert table[:reach] == [NULL_BLOCK] * reach and NULL_BLOCK not in table[reach:]
            assert bm.num_held_blocks(seq.seq_id) == len(table) - reach <= -(-window // size) + 2
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.policy.num_preemptions == 0 and bm.num_used_blocks == 0
