"""Structured output in the engine: every finished output matches its constraint (JSON schemas
checked with `jsonschema`, nobody's code here) under random weights and random sampling, across
chunked prefill and batches mixing constrained and free requests; a disaggregated or resumed
request's matcher catches up from the tokens alone; a reasoning model's thinking before the
constrained answer is free, whether its tags are text or tokens of their own."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from splitserve.engine.grammar import CHECKED_KEPT, GrammarMasks, InvalidConstraint
from splitserve.engine.demo import demo_tokenizer
from splitserve.engine.llm import LLM
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.engine.tokenizer import HFTokenizer
from tests.engine.hf_checkpoints import save_harmony_tokenizer, train_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
EOS = 257


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", policy="mixed", chunk_token_budget=32, num_kv_blocks=512)


def constrained(kind, value=None, **params) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=1.0, constraint=OutputConstraint.of(kind, value), **params)


def test_json_schema_outputs_parse_and_validate_under_random_sampling(llm):
    prompts = [f"Person {i}: " + "x" * (i * 7) for i in range(12)]
    outputs = llm.generate(prompts, [constrained("json_schema", SCHEMA, seed=i) for i in range(12)])
    for out in outputs:
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outputs}) > 6  # sampled, not one forced string


def test_every_kind_in_one_batch_with_a_free_request(llm):
    params = [constrained("regex", r"[a-z]{3,8}@(ex|demo)\.org", seed=1),
              constrained("choice", ["alpha", "beta", "gamma"], seed=2),
              constrained("json_object", seed=3),
              constrained("grammar", 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/', seed=4),
              SamplingParams(max_tokens=20, seed=5)]
    regex, choice, obj, lark, free = llm.generate(["a", "b", "c", "d", "e"], params)
    assert re.fullmatch(r"[a-z]{3,8}@(ex|demo)\.org", regex.text)
    assert choice.text in ("alpha", "beta", "gamma")
    if obj.finish_reason == "stop":  # any object may run past max_tokens under random weights
        assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", lark.text)
    assert free.finish_reason == "length" and len(free.token_ids) == 20


def test_greedy_constrained_output_is_the_masked_argmax(llm):
    out = llm.generate(["Pick:"], SamplingParams(max_tokens=20, temperature=0, constraint=OutputConstraint.of(
        "choice", ["left", "right"])))[0]
    assert out.text in ("left", "right")


def test_a_matcher_catches_up_on_tokens_it_did_not_sample():
    """A token worker's first token came from the prompt worker; a failover's prompt ends with
    tokens an earlier attempt generated (`resumed_tokens`): the mask continues either way."""
    masks = GrammarMasks(demo_tokenizer(), 259)
    imported = Sequence("i", [256, 65], constrained("choice", ["abc", "abd"]), eos_token_ids=frozenset({EOS}))
    imported.append_token(ord("a"))
    params = SamplingParams(constraint=OutputConstraint("choice", json.dumps(["abc", "abd"])), resumed_tokens=2)
    resumed = Sequence("r", [256, 65, ord("a"), ord("b")], params, eos_token_ids=frozenset({EOS}))
    logits = masks.apply(torch.zeros(2, 259), [imported, resumed])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("b")]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("c"), ord("d")]


def test_a_checked_constraints_matcher_serves_the_next_request_of_it(monkeypatch):
    """The matcher `check` built (and masked once) is the one a request's first mask uses; a second
    request of the same constraint, or the first again after its matcher is gone, builds its own."""
    masks = GrammarMasks(demo_tokenizer(), 259)
    built = []
    monkeypatch.setattr(masks, "_new_matcher", lambda c, new=masks._new_matcher: built.append(c) or new(c))
    constraint = OutputConstraint("choice", json.dumps(["abc", "abd"]))
    masks.check(constraint)
    seqs = [Sequence(name, [256], SamplingParams(constraint=constraint), eos_token_ids=frozenset({EOS}))
            for name in "ab"]
    for seq in seqs:
        seq.append_token(ord("a"))
    logits = masks.apply(torch.zeros(2, 259), seqs)
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [[ord("b")]] * 2
    assert len(built) == 2  # check's, used by "a"; "b"'s own
    masks.check(constraint)
    for k in range(CHECKED_KEPT):  # as many others checked after it as are kept: its matcher goes
        masks.check(OutputConstraint("regex", f"x{k}"))
    masks.forget("a")
    masks.apply(torch.zeros(1, 259), seqs[:1])
    assert len(built) == 3 + CHECKED_KEPT + 1


def test_a_token_outside_the_grammar_leaves_only_eos():
    masks = GrammarMasks(demo_tokenizer(), 259)
    seq = Sequence("s", [256], constrained("regex", "[0-9]+"), eos_token_ids=frozenset({EOS}))
    seq.append_token(ord("x"))
    assert torch.isfinite(masks.apply(torch.zeros(1, 259), [seq])[0]).nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize("kind, value, needle", [("regex", "[a-z", "unclosed"),
                                                  ("json_schema", {"type": "nonsense"}, "nonsense"),
                                                  ("grammar", "start: (", "Expected"),
                                                  ("regex", r"[^\s\S]+", "no text can match it"),
                                                  ("grammar", "start: /[^\\s\\S]/", "no text can match it")])
def test_a_constraint_that_does_not_compile_is_refused_at_add_request(llm, kind, value, needle):
    with pytest.raises(InvalidConstraint, match=needle):
        llm.generate(["x"], constrained(kind, value))
    assert not llm.engine.has_unfinished_requests()


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("kind, value, message", [("choice", [], "non-empty"), ("json_schema", "[1]", "object"),
                                                   ("regex", "", "empty"), ("xml", "a", "kind"),
                                                   ("json_schema", DEEP, "nested too deeply"),
                                                   ("choice", DEEP, "nested too deeply")])
def test_malformed_constraints_fail_on_construction(kind, value, message):
    with pytest.raises(ValueError, match=message):
        OutputConstraint.of(kind, value)


def test_constraints_refuse_ignore_eos_and_min_tokens():
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match="cannot be combined"):
            constrained("json_object", **extra)


def test_objects_hold_only_their_listed_properties_unless_others_are_allowed(llm):
    """vLLM's default (xgrammar's strict mode): a schema that lists properties and says nothing of
    others gets no others; one that allows them may get them."""
    listed = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}}
    outputs = llm.generate(["x"] * 8, [constrained("json_schema", listed, seed=i) for i in range(8)])
    assert all(set(json.loads(o.text)) <= {"k"} for o in outputs if o.finish_reason == "stop")
    assert sum(o.finish_reason == "stop" for o in outputs) >= 6


def test_closing_objects_leaves_data_and_all_of_parts_as_they_are(llm):
    """A const is data, not a schema: the output is the value as written. The parts of an allOf
    each list some of one object's properties: closed, no object could hold both."""
    value = {"properties": 1}
    [out] = llm.generate(["x"], constrained("json_schema", {"const": value}, seed=0))
    assert out.finish_reason == "stop" and json.loads(out.text) == value
    both = {"allOf": [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"const": 2}}, "required": ["b"]}]}
    llm.engine.sampler.grammar.check(OutputConstraint.of("json_schema", both))  # satisfiable: {"a": 1, "b": 2}


# ---- a reasoning model's free thinking before the constrained answer ------------------------
def tag_tokenizer(tmp_path, added: bool) -> HFTokenizer:
    """A byte-level BPE tokenizer; `added`: `<think>` and `</think>` are added tokens (as in
    Qwen3's tokenizer.json), which llguidance reads as special tokens, never as text."""
    raw = train_tokenizer(qwen2=True)
    if added:
        raw.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    return HFTokenizer(tmp_path)


@pytest.fixture(params=["bytes", "bpe", "bpe_added_tags"])
def tokenizer(request, tmp_path):
    return demo_tokenizer() if request.param == "bytes" else tag_tokenizer(tmp_path, request.param == "bpe_added_tags")


def allowed_next(tokenizer, constraint: OutputConstraint, output: str) -> set[str]:
    """The texts of the tokens the mask allows after `output` (EOS as "EOS"; tokens are decoded
    with their special text, so an added `</think>` reads as itself)."""
    vocab = tokenizer.vocab_size
    seq = Sequence("s", [0], SamplingParams(constraint=constraint), eos_token_ids=frozenset(tokenizer.eos_token_ids))
    for token_id in tokenizer.encode(output, add_special_tokens=False):
        seq.append_token(token_id)
    logits = GrammarMasks(tokenizer, vocab).apply(torch.zeros(1, vocab), [seq])[0]
    return {"EOS" if i in tokenizer.eos_token_ids else tokenizer.decode([i], skip_special_tokens=False)
            for i in torch.isfinite(logits).nonzero().flatten().tolist()}


def thinking(kind, value, mode) -> OutputConstraint:
    plain = OutputConstraint.of(kind, value)
    return OutputConstraint(plain.kind, plain.spec, mode)


NUMBER = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


def test_an_open_thinking_is_free_until_it_closes_then_the_schema_holds(tokenizer):
    constraint = thinking("json_schema", NUMBER, "open")
    free = allowed_next(tokenizer, constraint, "I think {x")
    assert {"x", "{", "<", "\n"} <= free and "EOS" not in free  # the answer must still come
    answer = allowed_next(tokenizer, constraint, "I think {x}</think>\n\n")
    assert "{" in answer and not {"x", "<", "EOS"} & answer
    assert allowed_next(tokenizer, constraint, 'a</think>\n{"n":12}') == {"EOS"}
    at_once = allowed_next(tokenizer, thinking("json_schema", NUMBER, ""), "")
    assert at_once <= answer and not "".join(answer - at_once).strip()  # the same, and blanks


def test_an_optional_thinking_may_open_first_or_the_answer_starts_at_once(tokenizer):
    constraint = thinking("choice", ["yes", "no"], "optional")
    first = allowed_next(tokenizer, constraint, "")
    assert "x" not in first and {"y", "n"} <= {t[:1] for t in first}
    assert any(t.startswith("<") for t in first)  # the opening tag (whole when it is a token)
    assert "x" in allowed_next(tokenizer, constraint, "<think>\nhm")
    assert allowed_next(tokenizer, constraint, "<think>\nhm, yes</think>\n\nn") == {"o"}
    assert not any(t.startswith("<") for t in allowed_next(tokenizer, thinking("choice", ["yes", "no"], ""), ""))


@pytest.mark.parametrize("mode, resumed", [("open", "Two and three.</think>\n\n"),
                                          ("optional", "<think>Add.</think>\n")])
def test_generation_after_a_thinking_matches_the_schema(llm, mode, resumed):
    """A failover resumes after the thinking: the matcher catches up on it, the answer validates."""
    prompt = "Q: 2+3?\n" + ("<think>" if mode == "open" else "") + resumed
    params = [SamplingParams(max_tokens=200, seed=i, resumed_tokens=len(resumed.encode()),
                             constraint=thinking("json_schema", SCHEMA, mode)) for i in range(6)]
    outputs = llm.generate([prompt] * 6, params)
    for out in outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_gpt_oss_may_write_its_analysis_then_the_schema_holds_in_its_final_message(tmp_path):
    tokenizer = save_harmony_tokenizer(tmp_path)
    constraint = thinking("json_schema", NUMBER, "harmony")
    GrammarMasks(tokenizer, tokenizer.vocab_size).check(constraint)
    assert allowed_next(tokenizer, constraint, "") == {"<|channel|>"}  # a message header first
    free = allowed_next(tokenizer, constraint, "<|channel|>analysis<|message|>I think {x")
    assert {"x", "{", "<|end|>"} <= free and not {"EOS", "<|channel|>"} & free
    final = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>"
    answer = allowed_next(tokenizer, constraint, final)
    assert "{" in answer and not {"x", "EOS", "<|end|>"} & answer
    assert allowed_next(tokenizer, constraint, final + '{"n":12}') == {"EOS"}
    assert "{" in allowed_next(tokenizer, constraint, "<|channel|>final<|message|>")  # no analysis: low effort
