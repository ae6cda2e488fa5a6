"""A model with sliding windows keeps only a window's KV blocks per sequence in its windowed layer
groups (every layer of a Mistral; Gemma 2's, Gemma 3's, GPT-OSS's, OLMo 3's, EXAONE 4's and Cohere
2's windowed layers beside their full ones): long generations in a cache far too small for their
whole tables still match transformers, with no preemption, and each windowed table's released
blocks are exactly those out of every later query's reach; a token engine imports a long prompt
into a window's blocks."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import NULL_BLOCK
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import pack_all, slot_index, unpack_all
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS, generation_prompts, hf_greedy, prompt_ids, tokenizers_by_kind, write_checkpoint,
)

NEW = 40
# blocks of 8 tokens; the six sequences' whole tables would take 60 blocks a layer group
BLOCKS = {"mistral_window": 32, "gemma2": 80, "gemma3": 80, "gpt_oss": 80, "olmo3": 80, "exaone4": 80, "cohere2": 80}


@pytest.fixture(scope="module", params=list(BLOCKS))
def windowed(request, tmp_path_factory, tokenizers_by_kind):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), write_checkpoint(path, request.param, tokenizers_by_kind)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_long_generations_in_a_small_cache_match_hf(windowed, policy):
    name, path, hf = windowed
    window, size = hf.config.sliding_window, ENGINE_ARGS["block_size"]
    prompts = generation_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    engine = LLMEngine(path, **{**ENGINE_ARGS, "num_kv_blocks": BLOCKS[name]}, policy=policy, chunk_token_budget=16,
                       prompt_token_budget=48, dtype="float32", max_model_len=128)
    bm = engine.block_manager
    assert window in bm.windows and bm.num_blocks == BLOCKS[name] - 1
    assert bm.num_groups == (1 if name == "mistral_window" else 2)  # the full layers' group beside the windowed
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
        engine.check_integrity()
        for seq in engine.policy.running:
            for table, group_window in zip(bm.block_tables(seq.seq_id), bm.windows):
                reach = 0 if group_window is None else max(0, seq.num_computed_tokens - window + 1) // size
                assert table[:reach] == [NULL_BLOCK] * reach and NULL_BLOCK not in table[reach:]
                if group_window and seq.is_decoding:  # a prompt holds all its blocks until computed
                    assert len(table) - reach <= -(-window // size) + 2
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.policy.num_preemptions == 0 and bm.num_used_blocks == 0


def test_long_prompts_prefilled_chunk_by_chunk_hold_a_window_and_a_chunk_and_match_hf(windowed):
    """The mixed policy admits a prompt by the blocks it holds at once as its chunks go: a
    windowed table never holds more than a chunk and a window's blocks. Where every layer slides,
    the second of two prompts each longer than half the cache starts in the step that ends the
    first's prefill (taken whole, it would wait for the first's blocks to be released)."""
    name, path, hf = windowed
    window, chunk = hf.config.sliding_window, 16
    vocab = hf.config.vocab_size
    prompts = [prompt_ids(40, 100, vocab), prompt_ids(41, 90, vocab), prompt_ids(42, 5, vocab)]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    groups = 1 if name == "mistral_window" else 2
    engine = LLMEngine(path, **{**ENGINE_ARGS, "num_kv_blocks": 16 * groups + 1}, policy="mixed", dtype="float32",
                       chunk_token_budget=chunk, max_model_len=128)
    bm = engine.block_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
    done, overlap = {}, None
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
        engine.check_integrity()
        first, second = engine.policy.find("0"), engine.policy.find("1")
        if overlap is None and first is not None and first.num_output_tokens:
            overlap = second.num_computed_tokens > 0
        for seq in [s for s in engine.policy.running if not s.is_decoding]:
            for table, group_window in zip(bm.block_tables(seq.seq_id), bm.windows):
                if group_window:
                    assert len(table) - table.count(NULL_BLOCK) <= bm.blocks_for(chunk + window - 1) + 1
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert overlap == (name == "mistral_window")  # with a full layer group, its blocks are too many


def test_a_token_engine_imports_long_prompts_into_a_windows_blocks_and_matches_hf(windowed):
    """A handed-off prompt's KV lands in a token engine whose windowed tables reserve only what
    its first decode reaches, and only those positions travel (`BlockManager.held_from`: nothing
    lands in the reserved block): two prompts whose whole tables would not fit in its cache are imported at once
    and decode as transformers does."""
    name, path, hf = windowed
    window, size, new = hf.config.sliding_window, ENGINE_ARGS["block_size"], 8
    prompts = [prompt_ids(50, 100, hf.config.vocab_size), prompt_ids(51, 90, hf.config.vocab_size)]
    expected = [hf_greedy(hf, p, new) for p in prompts]
    groups, max_len = (1 if name == "mistral_window" else 2), 128
    full = sum(-(-(len(p) + new) // size) for p in prompts) if groups == 2 else 0
    # a window's blocks per sequence while it decodes; the cache holds at least max_model_len tokens (start-up)
    windowed_blocks = max(len(prompts) * (-(-window // size) + 2), max_len // size * groups - full)
    assert windowed_blocks < sum(-(-len(p) // size) for p in prompts)  # whole windowed tables would not fit
    args = {**ENGINE_ARGS, "dtype": "float32", "max_model_len": max_len}
    prompt_engine = LLMEngine(path, **args, policy="prompt", prompt_token_budget=128)
    token_engine = LLMEngine(path, **{**args, "num_kv_blocks": 1 + full + windowed_blocks}, policy="token")
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    for i, prompt in enumerate(prompts):
        prompt_engine.add_request(str(i), prompt, params)
    while prompt_engine.has_unfinished_requests():
        prompt_engine.step()
    bm, src, dst = token_engine.block_manager, prompt_engine.kv_cache, token_engine.kv_cache
    landing = []  # both reserved before either lands, as concurrent transfers are
    for i, prompt in enumerate(prompts):
        seq, blocks = prompt_engine.export_request(str(i))
        imported, tables = token_engine.reserve_import(str(i), prompt, params)
        for table, group_window in zip(tables, bm.windows):
            reach = 0 if group_window is None else (len(prompt) - window + 1) // size
            assert table[:reach] == [NULL_BLOCK] * reach and NULL_BLOCK not in table[reach:]
        starts = bm.held_from(imported)
        assert starts == tuple(0 if w is None else (len(prompt) - window + 1) // size * size for w in bm.windows)
        kv = pack_all(src, slot_index(blocks, size, len(prompt), src.data.device, starts))
        landing.append((str(i), slot_index(tables, size, len(prompt), dst.data.device, starts), kv,
                        seq.output_token_ids[0]))
        prompt_engine.release_request(str(i))
    token_engine.check_integrity()
    for request_id, slots, kv, first in landing:
        unpack_all(dst, slots, kv)
        token_engine.complete_import(request_id, first)
    assert not dst.data[:, :, NULL_BLOCK].any()
    done = {}
    while token_engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in token_engine.step() if out.finished)
        token_engine.check_integrity()
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert token_engine.policy.num_preemptions == 0 and bm.num_used_blocks == 0
