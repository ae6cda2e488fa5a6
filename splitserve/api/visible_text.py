"""Token ids to the text a client sees, at the ingress, across failovers.

The ingress owns the visible text: it detokenizes every generated token (whichever worker made
it), finds stop strings, and while streaming holds back a suffix that could still become a stop
string, so streamed text is never taken back. Invariant: `visible()` only grows.
"""
from __future__ import annotations

from splitserve.api.tags import tag_prefix_at_end
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Detokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._detokenizer = Detokenizer(tokenizer, params, prompt_token_ids)
        self._stops = params.stop
        self._sent = 0
        self.stopped = False  # a stop string ended the text
        self.token_ends: list[int] = []  # per token taken: the text's length once it was added

    def append(self, token_ids: tuple[int, ...] | list[int], ends_stop: bool = False) -> int:
        """How many of `token_ids` made it into the text (none after a stop string). `ends_stop`:
        the run ended with the last of them for "stop", which an engine reports after a stop string
        (found here too) or a stop token (EOS, a stop_token_id: no text)."""
        last = len(token_ids) - 1
        for taken, token_id in enumerate(token_ids):
            if self.stopped:
                return taken
            self.stopped = self._detokenizer.append(token_id, ends_stop and taken == last)
            self.token_ends.append(len(self._detokenizer.text))
        return len(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens spelled out), as logprobs name it."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id)

    def visible(self, final: bool) -> str:
        text = self._detokenizer.text
        if final or self.stopped:
            return text
        return text[:len(text) - self._held_back(text)]

    def delta(self, final: bool) -> str:
        """Text not yet sent; marks it sent."""
        text = self.visible(final)
        new, self._sent = text[self._sent:], len(text)
        return new

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        return max((tag_prefix_at_end(text, stop) for stop in self._stops), default=0)
