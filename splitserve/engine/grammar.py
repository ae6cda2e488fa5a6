"""Structured output: token masks from `OutputConstraint`s, through llguidance (a maintained
grammar library with no Python dependencies).

One matcher per constrained sequence, keyed by its id. The matcher is derived from the tokens
alone: before each mask it consumes whatever the sequence generated since (the prompt's resumed
tail after a failover, an imported first token, the last sampled one), so a prompt worker, a token
worker and a failover attempt all agree without shipping matcher state. A finished match allows
only the end-of-sequence tokens, so the request ends with EOS ("stop"). JSON is compact (no
whitespace between tokens of the syntax): random or weak models cannot pad it forever.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache

import llguidance as llg
import torch

from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sequence import Sequence
from splitserve.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("splitserve.grammar")
JSON_OPTIONS = {"whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)


class InvalidConstraint(ValueError):
    """The schema, regex or grammar does not compile (the request's fault: a 400)."""


class GrammarMasks:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """`vocab_size`: the logits' width (the model's, which may pad the tokenizer's)."""
        self.vocab_size = vocab_size
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self._words = (self._tokenizer.vocab_size + 31) // 32
        self._executor = llg.LLExecutor(num_threads=1)  # more threads were slower on small batches
        self._matchers: dict[str, tuple[llg.LLMatcher, int]] = {}  # seq id -> (matcher, tokens consumed)

    def check(self, constraint: OutputConstraint) -> None:
        """Raise InvalidConstraint unless the constraint compiles for this tokenizer."""
        try:
            error = llg.LLMatcher.validate_grammar(_grammar(constraint), self._tokenizer)
        except (ValueError, RuntimeError) as exc:
            error = str(exc)
        if error:
            raise InvalidConstraint(f"{constraint.kind}: {error}")

    def forget(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`logits` [len(seqs), vocab] with every token the constrained rows' matchers refuse at -inf."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.constraint is not None]
        if not rows:
            return logits
        matchers = [self._caught_up(seqs[i]) for i in rows]
        bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(),
                                               self._words * 4, len(rows))
        allowed = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
        unpacked = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1).bool()
        width = min(unpacked.shape[1], logits.shape[1])
        allowed[:, :width] = unpacked[:, :width]
        logits = logits.clone()
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def _caught_up(self, seq: Sequence) -> llg.LLMatcher:
        constraint = seq.params.constraint
        matcher, consumed = self._matchers.get(seq.seq_id) or (self._new_matcher(constraint), 0)
        generated = seq.token_ids[seq.num_prompt_tokens - constraint.resumed_tokens:]
        for token_id in generated[consumed:]:
            if not matcher.is_error() and not matcher.consume_token(token_id):
                # only a token outside the mask (an all -inf row sampled greedily); from here the
                # matcher allows EOS alone, so the request stops instead of running on unconstrained
                log.warning("sequence %s: token %d breaks its %s constraint: %s", seq.seq_id, token_id,
                            constraint.kind, matcher.get_error().splitlines()[0])
        self._matchers[seq.seq_id] = (matcher, len(generated))
        return matcher

    def _new_matcher(self, constraint: OutputConstraint) -> llg.LLMatcher:
        return llg.LLMatcher(self._tokenizer, _grammar(constraint), log_level=0)


@lru_cache(maxsize=256)
def _grammar(constraint: OutputConstraint) -> str:
    """The llguidance grammar text of a constraint (cached: schemas repeat across requests)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(json.loads(spec)))
    return llg.LLMatcher.grammar_from_lark(spec)


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
