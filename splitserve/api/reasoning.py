"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`): the text
between `<think>` and `</think>` is the chat message's `reasoning` (also sent as
`reasoning_content`, its older name), the rest its `content`.

One rule serves the models vLLM names `deepseek_r1` (DeepSeek-R1, QwQ) and `qwen3`: the thinking is
open from the first token when the prompt ends with `<think>` (templates that open it for the
model), or once the output begins with `<think>`; it ends at `</think>`, and the answer starts at
the first non-blank character after it. An output that never opens it (Qwen3 with
`enable_thinking: false`, whose template closes an empty one in the prompt) is all answer, as if
no parser were set. A thinking never closed (cut by max_tokens) is all reasoning.
"""
from __future__ import annotations

from splitserve.api.tags import tag_prefix_at_end

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending with this text leaves the model inside its thinking."""
    return prompt_tail.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Text pieces in, (reasoning, content) pieces out. A tag split across pieces is held until it
    is whole (or the output ends), so nothing handed out is ever taken back."""

    def __init__(self, thinking: bool):
        # start: may still open with <think>; thinking: until </think>; blank: skip blanks; answer: the rest
        self._state = "thinking" if thinking else "start"
        self.thought = thinking  # the output had a thinking part (even an empty one)
        self._held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        if self._state == "start":
            head = text.lstrip()
            if head.startswith(OPEN):
                text, self._state, self.thought = head[len(OPEN):], "thinking", True
            elif OPEN.startswith(head) and not final:  # blanks, or the tag's beginning: cannot tell yet
                self._held = text
                return "", ""
            else:
                self._state = "answer"
        reasoning = ""
        if self._state == "thinking":
            end = text.find(CLOSE)
            if end == -1:
                keep = 0 if final else tag_prefix_at_end(text, CLOSE)
                self._held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self._state = text[:end], text[end + len(CLOSE):], "blank"
        if self._state == "blank":
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self._state = "answer"
        return reasoning, text


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content): reasoning None when it never thought; content None
    when it thought and gave no answer."""
    splitter = ReasoningSplitter(thinking)
    reasoning, content = splitter.feed(text, final=True)
    if not splitter.thought:
        return None, content
    return reasoning, content or None

