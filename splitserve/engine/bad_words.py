"""vLLM's `bad_words`: words a request's output may not contain, as token ids.

Each word is tokenized twice (`BadWords.of`), as it would start the text and as it would follow a
space (a byte-level BPE writes " cat" and "cat" with different ids); both spellings are banned.
A one-token spelling's id is never sampled; a longer one's last id is not sampled where the output
so far ends with its other ids (transformers' `NoBadWordsLogitsProcessor`, over the output alone
as vLLM reads it: a prompt ending with a word's first tokens does not ban its last). Pure Python.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class BadWords:
    always: frozenset[int]  # one-token spellings: never sampled
    after: dict[int, tuple[tuple[int, ...], ...]]  # a longer spelling's second-to-last id -> its spellings

    @classmethod
    def of(cls, words: Sequence[str], tokenizer: Tokenizer) -> BadWords | None:
        """The words' spellings in `tokenizer`'s ids; None for no words."""
        spellings = {tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                     for word in words for prefix in ("", " ")}
        spellings.discard(())
        if not spellings:
            return None
        after: dict[int, list[tuple[int, ...]]] = {}
        for ids in spellings:
            if len(ids) > 1:
                after.setdefault(ids[-2], []).append(ids)
        return cls(frozenset(ids[0] for ids in spellings if len(ids) == 1),
                   {token: tuple(found) for token, found in after.items()})

    def banned(self, token_ids: Sequence[int], first_output: int) -> set[int]:
        """The ids the next token may not be, after `token_ids` whose output starts at `first_output`
        (a resumed request's earlier output included): only spellings whose second-to-last id ends
        the output are compared."""
        banned = set(self.always)
        end = len(token_ids)
        if end > first_output:
            for ids in self.after.get(token_ids[-1], ()):
                start = end - (len(ids) - 1)
                if start >= first_output and all(token_ids[start + i] == t for i, t in enumerate(ids[:-1])):
                    banned.add(ids[-1])
        return banned
