"""Requests to the engine on the built-in demo model (4 layers, byte tokenizer, seeded dummy
weights): sampling options (seeds, stop strings and ids, min_tokens, EOS, logprobs, timestamps),
prompt formats, and the errors for bad input, bad checkpoints and bad engine configs.
"""
from __future__ import annotations

import json

import pytest

from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm import LLM, offline_defaults
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import ENGINE, GREEDY, PROMPTS, assert_all_free, assert_same, run_engine
from tests.engine.engine_helpers import one_thread, reference  # noqa: F401  (pytest fixtures)


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------

def test_seeded_requests_reproduce_across_runs_and_batch_companions():
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = LLM(**ENGINE).generate([PROMPTS[3]], seeded)[0].token_ids
    again = LLM(**ENGINE).generate([PROMPTS[3]], seeded)[0].token_ids
    assert alone == again
    companions = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True), GREEDY,
                  SamplingParams(max_tokens=5, temperature=0.7, seed=99, ignore_eos=True)]
    llm = LLM(seed=77, **ENGINE)
    outputs = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[5], PROMPTS[3]], companions + [seeded])
    assert outputs[3].token_ids == alone
    assert outputs[1].token_ids == LLM(**ENGINE).generate([PROMPTS[2]], GREEDY)[0].token_ids


def _greedy_text(llm, prompt, max_tokens=24):
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    assert out.text.isascii()  # one token per character: token counts follow from text positions
    return out


def _pick_stop(text: str) -> tuple[str, int]:
    """A two-character stop string whose first occurrence is at index k >= 2."""
    for k in range(2, len(text) - 2):
        if text.index(text[k:k + 2]) == k:
            return text[k:k + 2], k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(include):
    llm = LLM(**ENGINE)
    full = _greedy_text(llm, "Hello, world!")
    stop, k = _pick_stop(full.text)
    out = llm.generate("Hello, world!", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=include))[0]
    assert out.finish_reason == "stop"
    assert out.text == (full.text[:k + 2] if include else full.text[:k])
    assert out.token_ids == full.token_ids[:k + 2]
    assert_all_free(llm.engine)


def test_stop_string_on_the_last_allowed_token_is_stop():
    llm = LLM(**ENGINE)
    full = _greedy_text(llm, "Hello, world!")
    stop, k = _pick_stop(full.text)
    out = llm.generate("Hello, world!", SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True,
                                                       stop=[stop]))[0]
    assert out.text == full.text[:k]
    assert out.finish_reason == "stop"


def test_without_detokenize_the_text_is_empty_and_the_tokens_the_same():
    llm = LLM(**ENGINE)
    full = _greedy_text(llm, "Hello, world!")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert params.ids_only().detokenize is False and params.ids_only().ids_only() == params.ids_only()
    out = llm.generate("Hello, world!", params.ids_only())[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("", full.token_ids, "length")
    stop, _ = _pick_stop(full.text)
    with_stop = SamplingParams(max_tokens=24, stop=[stop])
    assert with_stop.ids_only() is with_stop  # finding a stop string needs the text
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=[stop], detokenize=False)


def test_stop_token_ids_min_tokens_and_max_tokens():
    llm = LLM(**ENGINE)
    full = llm.generate([PROMPTS[6]], GREEDY)[0].token_ids
    target = full[2]
    out = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[target]))[0]
    cut = full.index(target) + 1
    assert out.token_ids == full[:cut] and out.finish_reason == "stop"
    # the stop token's text is left out (vLLM's rule), unless include_stop_str_in_output
    decode = llm.engine.tokenizer.decode
    assert out.text == decode(full[:cut - 1]) and out.text != decode(full[:cut])
    kept = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[target], include_stop_str_in_output=True))[0]
    assert kept.text == decode(full[:cut])
    # below min_tokens the stop id is masked out of sampling, so it neither appears nor stops
    out = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=8, min_tokens=cut + 1, temperature=0.0,
                                                    ignore_eos=True, stop_token_ids=[target]))[0]
    assert len(out.token_ids) >= cut + 1
    assert target not in out.token_ids[:cut + 1]
    if target in out.token_ids:
        assert out.token_ids.index(target) == len(out.token_ids) - 1 and out.finish_reason == "stop"
    else:
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
    out = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == full[:3] and out.finish_reason == "length"
    assert_all_free(llm.engine)


def test_eos_ignore_eos_and_min_tokens():
    """The demo never samples its real EOS greedily, so the engine's EOS set is pointed at the
    token greedy decoding emits first."""
    engine = LLMEngine(**ENGINE)
    prompt = PROMPTS[3]
    full = run_engine(engine, {"full": (prompt, GREEDY)})["full"].token_ids
    engine.eos_token_ids = frozenset({full[0]})
    params = dict(max_tokens=12, temperature=0.0)
    outs = run_engine(engine, {"eos": (prompt, SamplingParams(**params)),
                               "ignore": (prompt, SamplingParams(**params, ignore_eos=True)),
                               "min": (prompt, SamplingParams(**params, min_tokens=4))})
    assert outs["eos"].token_ids == full[:1] and outs["eos"].finish_reason == "stop"
    assert outs["ignore"].token_ids == full and outs["ignore"].finish_reason == "length"
    held_back = outs["min"].token_ids
    assert len(held_back) >= 4 and full[0] not in held_back[:4]  # masked below min_tokens
    assert outs["min"].finish_reason == ("stop" if held_back[-1] == full[0] else "length")
    assert_all_free(engine)


def test_logprobs_and_timestamps():
    llm = LLM(**ENGINE)
    greedy, random_ = (SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
                       SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=2))
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    none = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[3]], [greedy, random_, plain, none])
    for out, n in zip(outs[:3], (3, 2, 0)):
        logprobs = out.outputs[0].logprobs
        assert len(logprobs) == len(out.token_ids) == 6
        for tok, entry in zip(out.token_ids, logprobs):
            assert tok in entry and all(v <= 0 for v in entry.values())
            assert n <= len(entry) <= n + 1 and len(entry) >= 1
    for tok, entry in zip(outs[0].token_ids, outs[0].outputs[0].logprobs):
        assert entry[tok] == max(entry.values()) and len(entry) == 3  # greedy: the top token
    assert [list(e) for e in outs[2].outputs[0].logprobs] == [[t] for t in outs[2].token_ids]
    assert outs[3].outputs[0].logprobs is None
    for out in outs:
        stamps = out.token_timestamps
        assert len(stamps) == len(out.token_ids)
        assert all(a <= b for a, b in zip(stamps, stamps[1:]))
    # logprobs do not change what is sampled
    assert outs[0].token_ids == llm.generate([PROMPTS[1]], GREEDY)[0].token_ids[:6]


# ---------------------------------------------------------------------------------------------
# inputs and outputs
# ---------------------------------------------------------------------------------------------

def test_prompt_forms_and_output_order():
    llm = LLM(**ENGINE)
    tok = llm.get_tokenizer()
    text = "Paged attention"
    ids = tok.encode(text)
    outputs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": text},
                            PROMPTS[5], [5]], GREEDY)
    assert [o.prompt for o in outputs] == [text, None, None, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outputs[:4])
    assert len({tuple(o.token_ids) for o in outputs[:4]}) == 1
    assert outputs[4].prompt_token_ids == PROMPTS[5] and outputs[5].prompt_token_ids == [5]
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    single = llm.generate(text, GREEDY)
    assert len(single) == 1 and single[0].token_ids == outputs[0].token_ids
    single = llm.generate(ids, GREEDY)
    assert len(single) == 1 and single[0].token_ids == outputs[0].token_ids
    assert outputs[0].text == tok.decode(outputs[0].token_ids)
    assert llm.generate([], GREEDY) == []
    assert_all_free(llm.engine)


def test_default_sampling_params():
    llm = LLM(**ENGINE)
    out = llm.generate("x")[0]
    assert 1 <= len(out.token_ids) <= SamplingParams().max_tokens


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for top_p in (0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=top_p)
    for field, value in [("logit_bias", [1, 2]), ("logit_bias", "x"), ("logit_bias", ((2, 100), (2, 100))),
                         ("ignore_eos", "no"), ("skip_special_tokens", "no"), ("include_stop_str_in_output", None),
                         ("detokenize", 1), ("stop_token_ids", [-1])]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    assert SamplingParams(logit_bias=None).logit_bias == ()


BAD_PROMPTS = [
    ([1] * 64, "max_model_len"),               # the prompt must leave room for a token
    ([1, 259], "prompt_token_ids"),            # vocab is 259
    ([-1, 3], "prompt_token_ids"),
    ([1, 2.0], "prompt_token_ids"),
    ([], "prompt_token_ids"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt": "no ids"}, "prompt_token_ids"),
    (None, "prompt_token_ids"),
]


@pytest.fixture(scope="module")
def small_engine_reference():
    engine = LLMEngine(max_model_len=64, num_kv_blocks=16)
    return run_engine(engine, {"a": (PROMPTS[3][:40], GREEDY), "b": (PROMPTS[2], GREEDY)})


def test_bad_requests_raise_and_running_requests_finish(small_engine_reference):
    engine = LLMEngine(max_model_len=64, num_kv_blocks=16)
    engine.add_request("a", PROMPTS[3][:40], GREEDY)
    engine.add_request("b", PROMPTS[2], GREEDY)
    finished = {}
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for prompt, field in BAD_PROMPTS:
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, GREEDY)
        assert engine.num_requests == 2
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [1, 2, 3], GREEDY)  # duplicate of a running request
    with pytest.raises(ValueError, match="params"):
        engine.add_request("bad", [1, 2, 3], {"max_tokens": 3})
    with pytest.raises(ValueError, match="max_model_len"):
        engine.reserve_import("bad", [1] * 64, GREEDY)
    engine.block_manager.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert {k: v.token_ids for k, v in finished.items()} == \
        {k: v.token_ids for k, v in small_engine_reference.items()}
    assert_all_free(engine)
    # a finished request's id is free again
    run_engine(engine, {"a": ([1, 2, 3], GREEDY)})
    assert_all_free(engine)


def test_llm_generate_with_one_bad_prompt_adds_none(reference):
    llm = LLM(**ENGINE)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([PROMPTS[0], PROMPTS[1], [1, 999], PROMPTS[2]], GREEDY)
    assert llm.engine.num_requests == 0 and not llm.engine.has_unfinished_requests()
    assert_all_free(llm.engine)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY])
    with pytest.raises(ValueError, match="params"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, "greedy"])
    assert llm.engine.num_requests == 0
    assert_same(llm.generate(PROMPTS, GREEDY), reference)


def test_an_offline_batch_on_a_gpu_takes_wide_chunks_unless_told_otherwise():
    """LLM's mixed steps on a GPU take OFFLINE_CHUNK_TOKENS (nothing waits on a token's latency);
    a budget given is kept, as is a whole EngineConfig's, and the CPU keeps EngineConfig's."""
    assert offline_defaults({"policy": "mixed"}, "cuda") == {"policy": "mixed", "chunk_token_budget": 8192}
    assert offline_defaults({"chunk_token_budget": 512}, "cuda") == {"chunk_token_budget": 512}
    config = EngineConfig(device="cpu", chunk_token_budget=256)
    assert offline_defaults({"config": config}, "cuda") == {"config": config}
    assert offline_defaults({"policy": "mixed"}, "cpu") == {"policy": "mixed"}
    assert LLM(**ENGINE).engine.config.chunk_token_budget == EngineConfig().chunk_token_budget == 512


# ---------------------------------------------------------------------------------------------
# checkpoint and engine config errors
# ---------------------------------------------------------------------------------------------

def test_missing_checkpoint_dir_names_it(tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(ValueError, match="nonexistent"):
        LLM(str(missing))
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent")


def test_empty_checkpoint_dir_names_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_malformed_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*malformed"):
        LLM(str(tmp_path))


def test_unsupported_architecture_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ConfigError, match="config.json.*architectures.*GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_missing_config_field_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ConfigError, match="config.json.*num_attention_heads"):
        LLM(str(tmp_path))


def test_bad_engine_config_names_the_field():
    with pytest.raises(ConfigError, match="policy"):
        LLMEngine(policy="fastest")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLMEngine(max_model_len=4096)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLMEngine(num_kv_blocks=4, max_model_len=128)


def test_llm_rejects_the_prompt_policy():
    with pytest.raises(ValueError, match="prompt"):
        LLM(policy="prompt", **ENGINE)
