"""The ingress's check that a request's structured-output constraint compiles, so a bad schema,
regex or grammar is a 400 naming its field before any worker sees it. The grammar tokenizer is
built on the first constrained request (a large vocabulary takes a moment)."""
from __future__ import annotations

from splitserve.api.errors import RequestError
from splitserve.engine.grammar import GrammarMasks, InvalidConstraint
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.tokenizer import Tokenizer


class LazyGrammar:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._masks: GrammarMasks | None = None

    def check(self, constraint: OutputConstraint, field: str) -> None:
        if self._masks is None:
            self._masks = GrammarMasks(self._tokenizer, self._vocab_size)
        try:
            self._masks.check(constraint)
        except InvalidConstraint as exc:
            raise RequestError(f"{field}: {exc}", param=field) from None
