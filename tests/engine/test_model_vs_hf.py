"""End-to-end correctness against Hugging Face transformers (the reference nobody here wrote).

Each checkpoint is a random tiny model built with transformers' own classes and written with its
own `save_pretrained`, next to a `tokenizer.json` trained with `tokenizers`. Our engine loads that
directory; its logits (full prefill, chunked prefill, decode, batched) and its greedy generations
must equal transformers' on the same weights.
"""
from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_model_config
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

# ASCII only, so every token decodes to complete characters (no held-back partial UTF-8).
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine, said the tailor to his apprentice",
    "Splitwise splits prompt and token phases across machines.",
    "Sarathi-Serve chunks long prefills: stall-free batching (2024)!",
    "paged attention stores keys and values in fixed-size blocks #42",
    "How much wood would a woodchuck chuck? QUITE A LOT; 1234567890",
] * 10
BOS, EOS, PAD = 0, 1, 2  # the trainer's special tokens come first
WEIGHT_STD = 0.2         # HF's 0.02 init gives near-uniform logits; this separates the argmax
MAX_POS = 256
ENGINE_ARGS = dict(device="cpu", block_size=8, num_kv_blocks=96)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=MAX_POS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
              rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CONFIGS = {
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, num_hidden_layers=3)),
    "llama3_gqa_tied": (LlamaConfig, LlamaForCausalLM,
                        dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                             tie_word_embeddings=True)),
    "mistral_gqa": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, rope_theta=1000000.0)),
    "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, rope_theta=1000000.0)),
    "llama_head_dim": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=32)),
}


# ---- checkpoint construction --------------------------------------------------------------
# Qwen2 checkpoints get Qwen2's pre-tokenizer (transformers' own regex). transformers 5's
# AutoTokenizer picks the tokenizer class from config.json's model_type, and Qwen2Tokenizer rebuilds
# its pre-tokenizer and NFC normalizer whatever tokenizer.json says; a real Qwen2 tokenizer.json has
# these, so the Qwen2 checkpoint gets them too (the engine reads tokenizer.json as it is).
def train_tokenizer(qwen2: bool = False) -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    if qwen2:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # every byte is a token, as in real byte-level vocabularies (any text encodes, "{" included)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] == [BOS, EOS, PAD]
    return tok


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[bool, RawTokenizer]:
    return {False: train_tokenizer(), True: train_tokenizer(qwen2=True)}


def randomize(model: torch.nn.Module) -> None:
    """Weights with std WEIGHT_STD; norm weights near (not exactly) one and biases non-zero, so a
    parameter that is not loaded, or loaded into the wrong place, changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, WEIGHT_STD)
            elif param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)


def write_checkpoint(path, name: str, tokenizers_by_kind: dict[bool, RawTokenizer]):
    config_cls, model_cls, extra = CONFIGS[name]
    raw_tokenizer = tokenizers_by_kind[config_cls is Qwen2Config]
    config = config_cls(**{**COMMON, **extra, "vocab_size": raw_tokenizer.get_vocab_size()})
    config._attn_implementation = "eager"  # the plainest reference math
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(config).eval()
    randomize(model)
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            add_bos_token=True).save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory, tokenizers_by_kind):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), write_checkpoint(path, request.param, tokenizers_by_kind)


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS] + torch.randint(PAD + 1, vocab, (length - 1,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


# ---- driving our model runner directly -------------------------------------------------------
def new_seq(engine: LLMEngine, seq_id: str, ids: list[int]) -> Sequence:
    seq = Sequence(seq_id, list(ids), SamplingParams())
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    assert seq.num_computed_tokens == 0
    return seq


@torch.inference_mode()
def run_plan(engine: LLMEngine, items: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
    """Run one iteration; return each sequence's logits [num_new_tokens, vocab] (float32), and
    advance its num_computed_tokens as the policy would."""
    plan = Plan(tuple(items))
    ordered = sorted(plan.scheduled, key=lambda item: item.num_new_tokens != 1)  # as ModelRunner.execute
    tables = {item.seq.seq_id: engine.block_manager.block_table(item.seq.seq_id) for item in ordered}
    runner = engine.runner
    input_ids, positions, meta = runner._prepare(ordered, tables)
    hidden = runner.model(input_ids, positions, runner._kv_layers, meta, runner.backend)
    logits = runner.model.compute_logits(hidden).float()
    out = {}
    for i, item in enumerate(ordered):
        out[item.seq.seq_id] = logits[meta.query_starts[i]:meta.query_starts[i + 1]]
        item.seq.num_computed_tokens = item.start + item.num_new_tokens
    return out


def append(engine: LLMEngine, seq: Sequence, token_id: int) -> None:
    seq.append_token(token_id)
    engine.block_manager.grow(seq, seq.num_tokens)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- config parsing ---------------------------------------------------------------------
def test_config_json_rope_is_parsed(ckpt):
    """transformers 5 writes rope_theta and the scaling inside `rope_parameters`; the engine's
    ModelConfig must carry the values the HF model actually uses."""
    path, hf = ckpt
    ours = load_model_config(path)
    rope = hf.config.rope_parameters
    assert ours.rope_theta == pytest.approx(rope["rope_theta"])
    assert ours.rope_scaling.rope_type == rope.get("rope_type", "default")
    if rope.get("rope_type") == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            assert getattr(ours.rope_scaling, key) == rope[key], key
    c = hf.config
    assert ours.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert ours.num_key_value_heads == hf.config.num_key_value_heads
    assert ours.tie_word_embeddings == hf.config.tie_word_embeddings


@pytest.mark.parametrize("layout", ["legacy", "v5"])
def test_rotary_frequencies_match_hf(tmp_path, tokenizers_by_kind, layout):
    """Our llama3-scaled inverse frequencies equal HF's rotary module's, from either config.json
    layout: transformers 4 (top-level rope_theta / rope_scaling, as most hub checkpoints have it)
    and transformers 5 (`rope_parameters`)."""
    from splitserve.engine.model.rotary import inverse_frequencies

    hf = write_checkpoint(tmp_path, "llama3_gqa_tied", tokenizers_by_kind)
    if layout == "legacy":
        cfg_file = tmp_path / "config.json"
        cfg = json.loads(cfg_file.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg_file.write_text(json.dumps(cfg))
    ours = load_model_config(tmp_path)
    inv = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    ref = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(inv, ref, rtol=1e-6, atol=0)


# ---- logits, float32 ----------------------------------------------------------------------
def test_prefill_logits_match_hf(ckpt):
    path, hf = ckpt
    engine = LLMEngine(path, dtype="float32", **ENGINE_ARGS)
    vocab = hf.config.vocab_size
    ids = prompt_ids(1, 37, vocab)  # spans 5 blocks of 8, the last one partial
    seq = new_seq(engine, "a", ids)
    ours = run_plan(engine, [ScheduledSeq(seq, len(ids))])["a"]
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (len(ids), vocab)
    assert ref.std().item() > 1.0  # logits are far from uniform, so the comparison means something
    assert max_diff(ours, ref) <= 1e-4, max_diff(ours, ref)


def test_chunked_prefill_then_decode_logits_match_hf(ckpt):
    """Chunks that attend to earlier chunks' cached KV, then single-token decode steps, each
    batched with another sequence's work in the same iteration."""
    path, hf = ckpt
    engine = LLMEngine(path, dtype="float32", **ENGINE_ARGS)
    vocab = hf.config.vocab_size
    a_ids, b_ids = prompt_ids(2, 30, vocab), prompt_ids(3, 21, vocab)
    a_ref, b_ref = hf_logits(hf, a_ids), hf_logits(hf, b_ids)
    a = new_seq(engine, "a", a_ids[:-3])   # prefill all but the last three tokens, in chunks
    b = new_seq(engine, "b", b_ids[:-1])   # prefill all but the last token in one go
    diffs = []

    out = run_plan(engine, [ScheduledSeq(a, 11), ScheduledSeq(b, len(b_ids) - 1)])
    diffs += [max_diff(out["a"], a_ref[:11]), max_diff(out["b"], b_ref[:-1])]
    out = run_plan(engine, [ScheduledSeq(a, 9)])  # a chunk that starts mid-block
    diffs.append(max_diff(out["a"], a_ref[11:20]))
    append(engine, b, b_ids[-1])
    out = run_plan(engine, [ScheduledSeq(a, len(a_ids) - 3 - 20), ScheduledSeq(b, 1)])  # b decodes
    diffs += [max_diff(out["a"], a_ref[20:-3]), max_diff(out["b"], b_ref[-1:])]
    for pos in range(len(a_ids) - 3, len(a_ids)):  # three decode steps of a
        append(engine, a, a_ids[pos])
        out = run_plan(engine, [ScheduledSeq(a, 1)])
        diffs.append(max_diff(out["a"], a_ref[pos:pos + 1]))
    assert max(diffs) <= 1e-4, diffs


def test_batched_decodes_of_different_lengths_match_hf(ckpt):
    path, hf = ckpt
    engine = LLMEngine(path, dtype="float32", **ENGINE_ARGS)
    vocab = hf.config.vocab_size
    prompts = [prompt_ids(10 + i, n, vocab) for i, n in enumerate((5, 17, 24, 9))]
    seqs = [new_seq(engine, str(i), p[:-1]) for i, p in enumerate(prompts)]
    run_plan(engine, [ScheduledSeq(s, s.num_tokens) for s in seqs])
    for s, p in zip(seqs, prompts):
        append(engine, s, p[-1])
    out = run_plan(engine, [ScheduledSeq(s, 1) for s in seqs])
    diffs = [max_diff(out[str(i)][0], hf_logits(hf, p)[-1]) for i, p in enumerate(prompts)]
    assert max(diffs) <= 1e-4, diffs


# ---- greedy generation --------------------------------------------------------------------
NEW_TOKENS = 12


def generation_prompts(vocab: int) -> list[list[int]]:
    prompts = [prompt_ids(20 + i, n, vocab) for i, n in enumerate((3, 40, 9, 17, 26))]
    return prompts + [prompts[1][:20] + prompt_ids(99, 6, vocab)[1:]]  # shares a 2-block prefix


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int, **options) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD, **options)
    return out[0, len(ids):].tolist()


def test_logprobs_match_hf_log_softmax(ckpt):
    """Each generated token's logprob and its top alternatives: transformers' log-softmax of the
    logits at that position, within 1e-4 (float32), with chunked prefill and batched decodes."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=3))
    for prompt, out in zip(prompts, outputs):
        expected = hf_logits(hf, prompt + out.token_ids).log_softmax(dim=-1)[len(prompt) - 1:-1]
        for step, (token_id, logprobs) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
            top = expected[step].topk(3)
            assert set(logprobs) == set(top.indices.tolist()) | {token_id}
            for t, value in logprobs.items():
                assert abs(value - expected[step, t].item()) < 1e-4, (step, t)


def test_prompt_logprobs_match_hf_log_softmax_even_where_the_prefix_is_cached(ckpt):
    """Every prompt position after the first: its token's logprob and the top alternatives, from
    transformers' log-softmax at the position before, within 1e-4, through chunked prefills. The
    prompts' prefixes are cached by a first run; a run asking for prompt logprobs computes them anyway."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    assert sum(o.num_cached_tokens for o in llm.generate(prompts, SamplingParams(max_tokens=1))) > 0
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.outputs[0].logprobs is None
        expected = hf_logits(hf, prompt).log_softmax(dim=-1)
        for position in range(1, len(prompt)):
            logprobs, row = out.prompt_logprobs[position], expected[position - 1]
            assert set(logprobs) == set(row.topk(2).indices.tolist()) | {prompt[position]}
            for t, value in logprobs.items():
                assert abs(value - row[t].item()) < 1e-4, (position, t)


def test_structured_output_over_a_bpe_vocabulary_parses_and_validates(ckpt):
    """The grammar masks read a trained BPE tokenizer.json (multi-byte tokens, specials); every
    sampled output is JSON that `jsonschema` accepts."""
    path, _ = ckpt
    schema = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
              "properties": {"word": {"enum": ["fox", "dog", "tailor"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}}}
    llm = LLM(path, dtype="float32", **ENGINE_ARGS)
    params = [SamplingParams(max_tokens=40, seed=i, constraint=OutputConstraint.of("json_schema", schema))
              for i in range(6)]
    for out in llm.generate(["the quick brown fox"] * 6, params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_generation_with_a_repetition_penalty_and_biases_matches_hf(ckpt, penalty):
    """transformers' `repetition_penalty` (over prompt and output) and `sequence_bias` for single
    tokens, against ours; a bias large enough changes the text, so the bias is really applied."""
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    bias = {5: 4.0, 9: -3.0, 11: 2.5}
    expected = [hf_greedy(hf, p, NEW_TOKENS, repetition_penalty=penalty,
                          sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts]
    llm = LLM(path, policy="mixed", chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            repetition_penalty=penalty, logit_bias=bias)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    plain = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert expected != plain


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_greedy_generation_matches_hf(ckpt, policy):
    path, hf = ckpt
    prompts = generation_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(path, policy=policy, chunk_token_budget=16, prompt_token_budget=48, dtype="float32", **ENGINE_ARGS)
    # min_tokens bans eos like HF's min_new_tokens, so neither side stops early
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    # again on the same engine: the prompts' full blocks now come from the prefix cache
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


# ---- half precision -----------------------------------------------------------------------
_HALF_MODELS: dict = {}


def hf_in(path: str, model, dtype):
    """A copy of the HF model in `dtype`, built once per checkpoint and dtype. Keyed by the
    checkpoint's path, not id(model): ids are reused once a fixture's model is collected."""
    key = (path, dtype)
    if key not in _HALF_MODELS:
        _HALF_MODELS[key] = copy.deepcopy(model).to(dtype)
    return _HALF_MODELS[key]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_close_to_hf(ckpt, dtype):
    path, hf = ckpt
    torch_dtype = getattr(torch, dtype)
    engine = LLMEngine(path, dtype=dtype, **ENGINE_ARGS)
    assert engine.runner.model.lm_head.weight.dtype == torch_dtype
    assert engine.kv_cache.data.dtype == torch_dtype
    vocab = hf.config.vocab_size
    ids = prompt_ids(4, 33, vocab)
    seq = new_seq(engine, "a", ids[:-1])
    prefill = run_plan(engine, [ScheduledSeq(seq, len(ids) - 1)])["a"]
    append(engine, seq, ids[-1])
    decode = run_plan(engine, [ScheduledSeq(seq, 1)])["a"]
    ours = torch.cat([prefill, decode])
    assert torch.isfinite(ours).all()
    ref = hf_logits(hf_in(path, hf, torch_dtype), ids)
    span = (ref.max() - ref.min()).item()
    assert max_diff(ours, ref) < 0.05 * span, (max_diff(ours, ref), span)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


# ---- text prompts -------------------------------------------------------------------------
def test_text_prompt_tokenized_like_autotokenizer(ckpt):
    path, hf = ckpt
    ref_tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32", **ENGINE_ARGS)
    texts = ["the quick brown fox", "Sarathi-Serve chunks (2024)!", "zzz unseen words QQ"]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    outputs = llm.generate(texts, params)
    for text, out in zip(texts, outputs):
        ids = ref_tok.encode(text)
        assert ids[0] == BOS
        assert out.prompt == text
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids, 6)
        # a final incomplete UTF-8 character is held back, where transformers spells it U+FFFD
        assert out.text == ref_tok.decode(out.token_ids, skip_special_tokens=True).rstrip("\ufffd")
