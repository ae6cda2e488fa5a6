"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`): the text
between `<think>` and `</think>` is the chat message's `reasoning` (also sent as
`reasoning_content`, its older name), the rest its `content`.

One rule serves the models vLLM names `deepseek_r1` (DeepSeek-R1, QwQ), `qwen3` and `minimax_m2`:
the thinking is open from the first token when the prompt ends with `<think>` (templates that
open it for the model: DeepSeek-R1's, MiniMax-M2's), or once the output begins with `<think>`; it
ends at `</think>`, and the answer starts at the first non-blank character after it. An output
that never opens it (Qwen3 with `enable_thinking: false`, whose template closes an empty one in
the prompt) is all answer, as if no parser were set. A thinking never closed (cut by max_tokens)
is all reasoning. Structured output (and a forced tool call) applies to the answer: the model
thinks freely first (`constraint_thinking`).

`openai_gptoss` (GPT-OSS) writes harmony channels instead (`harmony.HarmonySplitter`): its chat
text keeps special tokens, and a constrained answer holds in its final message, after any analysis.
"""
from __future__ import annotations

from collections.abc import Sequence

from splitserve.api.harmony import HarmonySplitter
from splitserve.api.tags import tag_prefix_at_end
from splitserve.engine.output_constraint import HARMONY
from splitserve.engine.output_constraint import THINK_CLOSE as CLOSE
from splitserve.engine.output_constraint import THINK_OPEN as OPEN
from splitserve.engine.tokenizer import Tokenizer

GPT_OSS = "openai_gptoss"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "minimax_m2", GPT_OSS)
PROMPT_TAIL_TOKENS = 16  # enough to spell a `<think>` the chat template ends the prompt with


def prompt_opens_thinking(prompt: Sequence[int], tokenizer: Tokenizer) -> bool:
    """Whether a prompt (its token ids) leaves the model inside its thinking: it ends with `<think>`."""
    return _prompt_tail(prompt, tokenizer).endswith(OPEN)


def constraint_thinking(prompt: Sequence[int], tokenizer: Tokenizer) -> str:
    """The OutputConstraint `thinking` of a chat answered with a reasoning parser: free thinking
    up to `</think>` when the prompt opened it; none when the prompt closed it (Qwen3's
    `enable_thinking: false`, an assistant prefill that thought already); else an optional
    `<think> ... </think>` first."""
    tail = _prompt_tail(prompt, tokenizer)
    return "open" if tail.endswith(OPEN) else "" if tail.endswith(CLOSE) else "optional"


def _prompt_tail(prompt: Sequence[int], tokenizer: Tokenizer) -> str:
    return tokenizer.decode(list(prompt[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False).rstrip()


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


def reasoning_splitter(thinking: bool | str) -> ReasoningSplitter | HarmonySplitter:
    """The splitter of an output whose prompt left the model `thinking` (or HARMONY)."""
    return HarmonySplitter() if thinking == HARMONY else ReasoningSplitter(thinking)


def split_reasoning(text: str, thinking: bool | str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content): reasoning None when it never thought or thought
    nothing (`<think></think>`: a stream sends no reasoning then, so a whole body has none either);
    content None when it thought and gave no answer."""
    splitter = reasoning_splitter(thinking)
    reasoning, content = splitter.feed(text, final=True)
    if not splitter.thought:
        return None, content
    return reasoning or None, content or None

