"""The FP8 KV cache (`kv_cache_dtype: fp8`) end to end against transformers: the same checkpoint
run by transformers with every key and value its attention reads rounded as our cache stores
them (torch's float8_e4m3fn of value / scale, times the scale), the checkpoint's k_scale / v_scale
loaded under both names checkpoints use; the cache's size in bytes; and the engine's options."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.attention import fp8_kv
from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import CheckpointError
from splitserve.engine.policies import ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS, NEW_TOKENS, generation_prompts, hf_greedy, hf_logits, prompt_ids, tokenizers_by_kind,
    write_checkpoint,
)
from tests.engine.runner_helpers import append, max_diff, new_seq, run_plan
from tests.engine.test_attention import stored
from tests.engine.tp_helpers import tp_engine

# GQA and tied embeddings; soft caps and windows (Gemma 2); sinks, a window, YaRN (GPT-OSS)
NAMES = ["llama3_gqa_tied", "gemma2", "gpt_oss"]
# per layer (K's, V's), float32 numbers: 1/128 saturates the largest keys at 448 codes, 2.0 sends
# small values subnormal
SCALES = [(1 / 128, 0.5), (2.0, 1 / 32)]


@pytest.fixture(scope="module", params=NAMES)
def scaled_ckpt(request, tmp_path_factory, tokenizers_by_kind):
    """A checkpoint with SCALES saved in it: layer 0 as compressed-tensors names them
    (`self_attn.k_scale`), layer 1 as ModelOpt does (`self_attn.k_proj.k_scale`)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = write_checkpoint(path, request.param, tokenizers_by_kind)
    tensors = load_file(path / "model.safetensors")
    (k0, v0), (k1, v1) = SCALES
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(k0),
                    "model.layers.0.self_attn.v_scale": torch.tensor(v0),
                    "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([k1]),
                    "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([v1])})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path), hf


@pytest.fixture
def hf_reads_fp8(monkeypatch):
    """Makes a transformers model's eager attention read keys and values as the FP8 cache returns them."""
    def patch(model, scales):
        module = sys.modules[type(model).__module__]
        eager = module.eager_attention_forward

        def rounded(attention, query, key, value, *args, **kwargs):
            k_scale, v_scale = scales[attention.layer_idx]
            return eager(attention, query, stored(key, k_scale), stored(value, v_scale), *args, **kwargs)

        monkeypatch.setattr(module, "eager_attention_forward", rounded)
    return patch


def test_logits_match_transformers_reading_the_same_codes(scaled_ckpt, hf_reads_fp8):
    """A prompt prefilled in chunks (the second starting mid-block), then decodes, float32."""
    path, hf = scaled_ckpt
    engine = LLMEngine(path, dtype="float32", kv_cache_dtype="fp8", **ENGINE_ARGS)
    assert [layer.self_attn.kv_scale for layer in engine.runner.model.model.layers] == SCALES
    ids = prompt_ids(4, 34, hf.config.vocab_size)
    plain = hf_logits(hf, ids)
    hf_reads_fp8(hf, SCALES)
    ref = hf_logits(hf, ids)
    seq = new_seq(engine, "a", ids[:-2])
    ours = [run_plan(engine, [ScheduledSeq(seq, 13)])["a"], run_plan(engine, [ScheduledSeq(seq, 19)])["a"]]
    for token in ids[-2:]:
        append(engine, seq, token)
        ours.append(run_plan(engine, [ScheduledSeq(seq, 1)])["a"])
    ours = torch.cat(ours)
    assert max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)
    assert max_diff(ours, plain) > 1e-2  # the codes are in effect: unrounded attention differs


def test_greedy_generation_matches_transformers_with_the_prefix_cache(scaled_ckpt, hf_reads_fp8):
    path, hf = scaled_ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    hf_reads_fp8(hf, SCALES)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(path, chunk_token_budget=16, dtype="float32", kv_cache_dtype="fp8", **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate(prompts, params)  # full blocks from the prefix cache: stored codes, reused
    assert [o.token_ids for o in again] == expected and sum(o.num_cached_tokens for o in again) > 0


def test_two_ranks_each_keep_their_heads_codes_and_match_one_rank(scaled_ckpt):
    """Tensor parallelism: each rank stores its KV heads' codes with the checkpoint's scales."""
    path, hf = scaled_ckpt
    args = dict(ENGINE_ARGS, dtype="float32", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = generation_prompts(hf.config.vocab_size)[:3]
    single = LLM(path, **args).generate(prompts, params)
    with tp_engine(path, 2, **args) as (engine, followers):
        assert engine.kv_cache.data.dtype == torch.uint8 and engine.kv_cache.data.shape[-2] == 1
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert not followers.errors
    for i, whole in enumerate(single):
        got, want = done[str(i)].outputs[0], whole.outputs[0]
        assert got.token_ids == want.token_ids
        for g, w in zip(got.logprobs, want.logprobs):
            assert max(abs(g[k] - w[k]) for k in w) < 1e-4


def test_the_same_bytes_hold_twice_the_tokens_of_bfloat16():
    args = dict(dtype="bfloat16", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    bf16, fp8 = LLM("demo", **args).engine, LLM("demo", kv_cache_dtype="fp8", **args).engine
    assert fp8.kv_cache.data.dtype == torch.uint8 and fp8.kv_cache.dtype == torch.bfloat16
    assert fp8.kv_cache.num_blocks == 2 * bf16.kv_cache.num_blocks
    assert fp8.kv_cache.data.nbytes == bf16.kv_cache.data.nbytes
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(LLM("demo", kv_cache_dtype="fp8", **args).generate([[256, 72, 105]], params)[0].token_ids) == 8


def test_scales_default_to_one_without_the_checkpoints_and_the_start_up_says_so(tmp_path, tokenizers_by_kind,
                                                                                scaled_ckpt, caplog):
    write_checkpoint(tmp_path, "llama_mha", tokenizers_by_kind)
    with caplog.at_level(logging.INFO, logger="splitserve.engine"):
        engine = LLMEngine(str(tmp_path), dtype="float32", kv_cache_dtype="fp8_e4m3", **ENGINE_ARGS)
        LLMEngine(scaled_ckpt[0], dtype="float32", kv_cache_dtype="fp8", **ENGINE_ARGS)
    assert {layer.self_attn.kv_scale for layer in engine.runner.model.model.layers} == {(1.0, 1.0)}
    assert engine.kv_cache.encoding == "fp8_e4m3"
    said = [r.getMessage() for r in caplog.records if "FP8 KV cache" in r.getMessage()]
    assert [line.split(" attention layers")[0] for line in said] == ["FP8 KV cache (e4m3): 0 of 3",
                                                                    "FP8 KV cache (e4m3): 2 of 2"]


@pytest.mark.parametrize("bad", [torch.tensor(0.0), torch.tensor(float("inf")), torch.tensor([0.5, 0.5])])
def test_a_scale_that_is_not_one_positive_number_is_refused(tmp_path, tokenizers_by_kind, bad):
    write_checkpoint(tmp_path, "llama_mha", tokenizers_by_kind)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.2.self_attn.v_scale": bad}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.2.self_attn.v_scale' must be one positive, finite"):
        LLMEngine(str(tmp_path), dtype="float32", kv_cache_dtype="fp8", **ENGINE_ARGS)


def test_an_unknown_kv_cache_dtype_names_the_choices():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_dequantizes_to_torchs_float8_value_times_the_scale(dtype):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    for scale in (1.0, 0.37, 1 / 128, 3.0e-3):
        want = (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)
        assert torch.equal(fp8_kv.dequantize(codes, scale, dtype), want)


def test_quantize_saturates_and_rounds_as_torch():
    x = torch.tensor([1000.0, -1000.0, 0.3, 1e-9, 17.0])
    codes = fp8_kv.quantize(x, 0.5)
    assert codes.dtype == torch.uint8
    assert fp8_kv.dequantize(codes, 0.5, torch.float32).tolist() == [224.0, -224.0, 0.3125, 0.0, 16.0]
