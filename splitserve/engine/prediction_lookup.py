"""Drafts from a request's `prediction` (OpenAI's Predicted Outputs: text much of the output is
expected to repeat, a file being edited), for `speculation.NgramProposer`.

The tokens after an occurrence in the prediction of the longest of the output's endings (its whole
output, from its start, matches the prediction's start whatever its length): first one ending where
the prediction, followed since the last match, has the output's end; else the earliest from the
last match on; else the earliest anywhere. So the output follows the prediction from its first
token, takes it up again where an edit ends, and a repeated line does not pull it back to its first
copy. Tokens are packed 4 bytes each, as the proposer packs a sequence's, so a search is
`bytes.find` at C speed.
"""
from __future__ import annotations

from array import array

from splitserve.engine.sampling_params import MAX_TOKEN_ID

TOKEN_BYTES = array("I").itemsize  # bytes a token takes packed
_START = array("I", [MAX_TOKEN_ID + 1]).tobytes()  # marks where an output, and its prediction, start


class PredictionLookup:
    """One sequence's prediction, packed after a start mark, and where its output follows it: the
    index in that marked copy of the token after the last match, and the output's length then."""

    __slots__ = ("marked", "matched", "matched_at")

    def __init__(self, prediction: tuple[int, ...]):
        self.marked = _START + array("I", prediction).tobytes()
        self.matched = self.matched_at = 0  # matched 0: no match yet

    def drafts(self, packed: bytearray, outputs: int, limit: int, shortest: int, longest: int) -> tuple[int, ...]:
        """Up to `limit` tokens of the prediction after the rule's occurrence (module doc) of the
        longest of the output's endings of `longest` down to `shortest` tokens; () where none
        occurs. `packed`: the sequence's tokens, its last `outputs` its output."""
        end = len(packed)
        endings = []  # (length, pattern), longest first
        for n in range(min(longest, outputs + 1), 0, -1):
            whole = n > outputs  # the output from its start: anchored at the prediction's start
            if n < shortest and not whole:
                break
            endings.append((n, (_START + bytes(packed[end - outputs * TOKEN_BYTES:])) if whole
                            else bytes(packed[end - n * TOKEN_BYTES:])))
        if self.matched:
            aligned = self.matched + outputs - self.matched_at
            for n, pattern in endings:
                if aligned >= n and self.marked[(aligned - n) * TOKEN_BYTES:aligned * TOKEN_BYTES] == pattern:
                    return self._follow(aligned, outputs, limit)
        for first in (self.matched, 0) if self.matched else (0,):
            for n, pattern in endings:
                found = _earliest(self.marked, pattern, max(0, first - n) * TOKEN_BYTES)
                if found is not None:
                    return self._follow(found // TOKEN_BYTES + n, outputs, limit)
        return ()

    def _follow(self, at: int, outputs: int, limit: int) -> tuple[int, ...]:
        """The prediction's tokens from index `at` of its marked copy, where the output goes on."""
        self.matched, self.matched_at = at, outputs
        return tuple(array("I", self.marked[at * TOKEN_BYTES:(at + limit) * TOKEN_BYTES]))


def _earliest(packed: bytes, pattern: bytes, start: int) -> int | None:
    """The byte offset of the earliest token-aligned occurrence of `pattern` in packed[start:]."""
    while (found := packed.find(pattern, start)) >= 0:
        if found % TOKEN_BYTES == 0:
            return found
        start = found + 1  # an unaligned match: look after it
    return None
