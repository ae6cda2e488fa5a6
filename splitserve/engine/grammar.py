"""Structured output: token masks from `OutputConstraint`s, through llguidance (a maintained
grammar library with no Python dependencies).

One matcher per constrained sequence, keyed by its id. The matcher is derived from the tokens
alone: before each mask it consumes whatever the sequence generated since (the prompt's resumed
tail after a failover, an imported first token, the last sampled one), so a prompt worker, a token
worker and a failover attempt all agree without shipping matcher state. A finished match allows
only the end-of-sequence tokens, so the request ends with EOS ("stop"). JSON is compact (no
whitespace between tokens of the syntax) and objects hold only the properties their schema lists
(unless it allows others): random or weak models cannot pad it forever. A constraint with a
`thinking` lets the model think freely before it (see output_constraint.py); its tags are written
as single tokens where the tokenizer has them as added tokens (Qwen3), since llguidance reads an
added token as special, never as text.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache

import llguidance as llg
import torch

from splitserve.engine.output_constraint import HARMONY, THINK_CLOSE, THINK_OPEN, OutputConstraint
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import upload, upload_list
from splitserve.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("splitserve.grammar")
JSON_OPTIONS = {"whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)
_BLANKS = r"/[ \t\r\n]*/"
CHECKED_KEPT = 64  # matchers `check` built, kept unused for the requests that follow it


class InvalidConstraint(ValueError):
    """The schema, regex or grammar does not compile (the request's fault: a 400)."""


class GrammarMasks:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """`vocab_size`: the logits' width (the model's, which may pad the tokenizer's)."""
        self.vocab_size = vocab_size
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        added = tokenizer.added_tokens if isinstance(tokenizer, HFTokenizer) else frozenset()
        self._tag_tokens = (THINK_OPEN in added, THINK_CLOSE in added)
        self._words = (self._tokenizer.vocab_size + 31) // 32
        self._matchers: dict[str, tuple[llg.LLMatcher, int]] = {}  # seq id -> (matcher, tokens consumed)
        # constraint -> a matcher `check` built, at its start (a mask leaves it there), the oldest first
        self._checked: dict[OutputConstraint, llg.LLMatcher] = {}

    def check(self, constraint: OutputConstraint) -> None:
        """Raise InvalidConstraint unless the constraint compiles for this tokenizer and something
        can match it (a matcher that fails before its first token would end the request "stop"
        with text that does not match)."""
        try:
            error = llg.LLMatcher.validate_grammar(_grammar(constraint, self._tag_tokens), self._tokenizer)
        except (ValueError, RuntimeError) as exc:
            error = str(exc)
        matcher = None if error else self._new_matcher(constraint)
        if matcher is not None and _fails_at_once(matcher):
            error = "no text can match it"
        if error:
            raise InvalidConstraint(f"{constraint.kind}: {error}")
        self._checked.pop(constraint, None)
        self._checked[constraint] = matcher  # the request checked next takes it: one matcher, not two
        if len(self._checked) > CHECKED_KEPT:
            del self._checked[next(iter(self._checked))]

    def forget(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def valid_drafts(self, seq: Sequence, drafts: tuple[int, ...]) -> int:
        """How many of `drafts` (speculated past seq's tokens) its constraint allows, from the first."""
        return self._caught_up(seq).validate_tokens(list(drafts))

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int] | None = None,
              drafts: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """`logits` [len(seqs), vocab] with every token the constrained rows' matchers refuse set
        to -inf, in place (the sampler owns its logits). With `offsets` and `drafts` (per row: its
        sequence's drafts, and how many come before the row; a sequence's rows in order), a row is
        masked as if the drafts before it were kept: its matcher consumes them for the row, and
        rolls them back after the sequence's last row (a draft it refuses ends that: no later
        row is kept, since the row before it cannot sample the draft)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.constraint is not None]
        if not rows:
            return logits
        bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        # one matcher after another: on a 32-row batch llguidance's thread-pool executor took 5x longer
        # (dispatch cost) than the masks themselves (~2 us each, 2-core CPU)
        address, row_bytes = bitmask.data_ptr(), self._words * 4
        matcher, consumed = None, 0
        for k, i in enumerate(rows):
            offset = 0 if offsets is None else offsets[i]
            if offset == 0:
                matcher, consumed = self._caught_up(seqs[i]), 0
            elif consumed == offset - 1 and matcher.validate_tokens([drafts[i][offset - 1]]) == 1:
                consumed += matcher.consume_token(drafts[i][offset - 1])
            matcher.unsafe_compute_mask_ptr(address + k * row_bytes, row_bytes)
            if consumed and offset == len(drafts[i]):
                matcher.rollback(consumed)
        refused = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1).eq(0)
        vocab = logits.shape[1]
        if refused.shape[1] < vocab:  # ids past the tokenizer's vocabulary (padding) are never allowed
            refused = torch.nn.functional.pad(refused, (0, vocab - refused.shape[1]), value=True)
        refused = upload(refused[:, :vocab].contiguous(), logits.device)
        if len(rows) == len(seqs):
            return logits.masked_fill_(refused, float("-inf"))
        index = upload_list(rows, torch.long, logits.device)
        logits[index] = logits[index].masked_fill(refused, float("-inf"))
        return logits

    def _caught_up(self, seq: Sequence) -> llg.LLMatcher:
        constraint = seq.params.constraint
        matcher, consumed = self._matchers.get(seq.seq_id) or (
            self._checked.pop(constraint, None) or self._new_matcher(constraint), 0)
        start = seq.num_prompt_tokens - seq.params.resumed_tokens  # a resumed request's output is matched too
        for token_id in seq.token_ids[start + consumed:]:
            if not matcher.is_error() and not matcher.consume_token(token_id):
                # only a token outside the mask (an all -inf row sampled greedily); from here the
                # matcher allows EOS alone, so the request stops instead of running on unconstrained
                log.warning("sequence %s: token %d breaks its %s constraint: %s", seq.seq_id, token_id,
                            constraint.kind, matcher.get_error().splitlines()[0])
        self._matchers[seq.seq_id] = (matcher, seq.num_tokens - start)
        return matcher

    def _new_matcher(self, constraint: OutputConstraint) -> llg.LLMatcher:
        return llg.LLMatcher(self._tokenizer, _grammar(constraint, self._tag_tokens), log_level=0)


def _fails_at_once(matcher: llg.LLMatcher) -> bool:
    """Whether the matcher fails on its first mask (it finds an empty language only computing one)."""
    matcher.compute_bitmask()
    return matcher.is_error()


@lru_cache(maxsize=256)
def _grammar(constraint: OutputConstraint, tag_tokens: tuple[bool, bool]) -> str:
    """The llguidance grammar text of a constraint (cached: schemas repeat across requests);
    `tag_tokens`: whether `<think>`, `</think>` are tokens of their own."""
    answer = _answer_grammar(constraint)
    if not constraint.thinking:
        return answer
    if constraint.kind in ("json_schema", "json_object", "regex"):  # llguidance built a TopLevelGrammar's JSON
        first, *rest = json.loads(answer)["grammars"]
    else:  # Lark text
        first, rest = {"lark_grammar": answer}, []
    lark = HARMONY_LARK if constraint.thinking == HARMONY else _thinking_lark(constraint.thinking, *tag_tokens)
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**first, "name": "answer"}, *rest]})


# GPT-OSS's analysis messages of free text (its markers are special tokens: the text ends at
# `<|end|>`), then its final message's header, then the answer's grammar
HARMONY_LARK = ('start: analysis* <|channel|> "final" <|message|> @answer\n'
                'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"\n')


def _thinking_lark(thinking: str, open_is_token: bool, close_is_token: bool) -> str:
    """Free text up to the first `</think>` (opened by `<think>`: required when "open", else
    optional), blanks, then the answer's grammar (`@answer`)."""
    opening = THINK_OPEN if open_is_token else json.dumps(THINK_OPEN)
    free = (f"thinking: /(?s:.*)/ {THINK_CLOSE}" if close_is_token  # the token ends the text
            else f"thinking[lazy]: /(?s:.*)/ {json.dumps(THINK_CLOSE)}")  # lazy: ends at the first one
    start = f"thinking {_BLANKS}" if thinking == "open" else f"({_BLANKS} {opening} thinking {_BLANKS})?"
    return f"start: {start} @answer\n{free}\n"


def _answer_grammar(constraint: OutputConstraint) -> str:
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(_closed(json.loads(spec))), overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(json.loads(spec)))
    return llg.LLMatcher.grammar_from_lark(spec)


# the keywords whose values are schemas, lists of them, or maps to them (a const, an enum, a
# default or an example is data, never rewritten)
_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
           "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema):
    """The schema with `additionalProperties: false` wherever it lists properties and says nothing
    of others (xgrammar's strict mode, vLLM's default): the output still matches the original
    schema, but never grows keys nobody asked for (a weak model would add them until max_tokens).
    A schema with `allOf` anywhere (in its text: a key or a word) stays as it is: its parts each
    list some of one object's properties, and closing one part would refuse the others'."""
    return schema if "allOf" in json.dumps(schema) else _close(schema)


def _close(schema):
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _close(value) for name, value in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [_close(value) for value in closed[key]]
    for key in _SCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = _close(closed[key])
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class _ByteVocabulary:
    """The byte tokenizer as llguidance's TokenizerWrapper reads it: ids 0..255 are the bytes;
    the specials and any padding ids up to the model's vocabulary are special (never text)."""

    def __init__(self, vocab_size: int):
        self.bos_token_id, self.eos_token_id = ByteTokenizer.BOS, ByteTokenizer.EOS
        self.tokens = [bytes([i]) for i in range(256)] + [s.encode() for s in ByteTokenizer.SPECIALS.values()]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocabulary(vocab_size)))
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids))
    raise TypeError(f"structured output needs a byte or Hugging Face tokenizer, got {type(tokenizer).__name__}")
