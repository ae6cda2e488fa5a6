"""LongRoPE (Phi-3.5, Phi-4-mini) against transformers: a sequence past the trained context turns
all its tokens by the long frequencies, so a long prompt is long from its first chunk, and a
sequence that grows past it is recomputed long (as transformers' generate() does), on a token
engine too; short and long sequences never share prefix-cache blocks."""
from __future__ import annotations

import pytest
import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.policies import ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import pack_all, slot_index, unpack_all
from tests.engine.hf_checkpoints import ENGINE_ARGS, hf_greedy, hf_logits, prompt_ids, write_checkpoint
from tests.engine.hf_checkpoints import tokenizers_by_kind  # noqa: F401 (fixture)
from tests.engine.runner_helpers import max_diff, new_seq, run_plan

TRAINED = 48  # the checkpoint's original_max_position_embeddings
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


@pytest.fixture(scope="module")
def phi(tmp_path_factory, tokenizers_by_kind):  # noqa: F811
    path = tmp_path_factory.mktemp("phi3_longrope")
    return str(path), write_checkpoint(path, "phi3_longrope", tokenizers_by_kind)


def engine(path: str, **overrides) -> LLMEngine:
    return LLMEngine(path, dtype="float32", **{**ENGINE_ARGS, **overrides})


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return done


def test_a_long_prompt_in_chunks_is_long_from_its_first_chunk(phi):
    path, hf = phi
    ids = prompt_ids(7, 70, hf.config.vocab_size)
    ours = engine(path)
    seq = new_seq(ours, "a", ids)
    logits = torch.cat([run_plan(ours, [ScheduledSeq(seq, n)])["a"] for n in (16, 30, 24)])
    assert max_diff(logits, hf_logits(hf, ids)) <= 1e-4


def test_growing_past_the_trained_context_recomputes_once(phi):
    path, hf = phi
    prompt = prompt_ids(8, 44, hf.config.vocab_size)  # its 5th generated token takes it past 48
    ours = engine(path, policy="mixed", chunk_token_budget=16)
    out = run(ours, {"a": prompt})["a"]
    assert out.token_ids == hf_greedy(hf, prompt, 12)
    assert ours.policy.num_preemptions == 1


def test_short_and_long_sequences_share_no_cached_blocks(phi):
    path, hf = phi
    vocab = hf.config.vocab_size
    short = prompt_ids(9, 32, vocab)  # with its 12 generated tokens still short: cached short
    long = short + prompt_ids(10, 29, vocab)[1:]  # 60 tokens: the same first 32, long KV throughout
    ours = engine(path)
    run(ours, {"short": short})
    first = run(ours, {"long": long})["long"]
    assert first.num_cached_tokens == 0 and first.token_ids == hf_greedy(hf, long, 12)
    again = run(ours, {"again": long})["again"]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_a_token_engine_recomputes_an_import_that_crosses(phi):
    """A prompt of exactly the trained context, prefilled short on a prompt engine: its first token
    takes it past, so the token engine recomputes it long before decoding."""
    path, hf = phi
    prompt = prompt_ids(11, TRAINED, hf.config.vocab_size)
    prompt_engine, token_engine = engine(path, policy="prompt"), engine(path, policy="token")
    prompt_engine.add_request("a", prompt, GREEDY)
    (first,) = prompt_engine.step()
    seq, blocks = prompt_engine.export_request("a")
    src, dst_cache = prompt_engine.kv_cache, token_engine.kv_cache
    kv = pack_all(src, slot_index(blocks, src.block_size, TRAINED, src.data.device))
    _, dst = token_engine.reserve_import("a", prompt, GREEDY)
    unpack_all(dst_cache, slot_index(dst, dst_cache.block_size, TRAINED, dst_cache.data.device), kv)
    token_engine.complete_import("a", first.token_ids[0])
    assert token_engine.policy.num_preemptions == 1
    done = {}
    while token_engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in token_engine.step() if out.finished)
    assert done["a"].token_ids == hf_greedy(hf, prompt, 12)
