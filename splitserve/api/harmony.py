"""GPT-OSS's output in OpenAI's harmony format, told apart into reasoning and answer (vLLM's
`openai_gptoss` reasoning parser). The output (special tokens kept) is a run of messages, each a
header and a body: `[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][<|constrain|>FORMAT]<|message|>`,
then the body up to `<|end|>` (the last one's up to the stop token, which the text leaves out).
The `analysis` channel is the reasoning; `final` and `commentary` (the preamble a model writes
before acting) are the answer. An output that does not open with a header (a constrained one:
its grammar holds from the first token) is all answer."""
from __future__ import annotations

from splitserve.api.tags import tag_prefix_at_end

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
REASONING_CHANNEL = "analysis"


class HarmonySplitter:
    """Text pieces in, (reasoning, content) pieces out, as `reasoning.ReasoningSplitter`: a header,
    or the end of a piece that may begin `<|end|>`, is held until it is whole (or the output ends)."""

    def __init__(self):
        self._state = "start"  # start: may open with a header; header; body; plain: no headers, all answer
        self._reasoning = False  # the body being read is the analysis channel's
        self.thought = False  # an analysis message was opened
        self._held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                if text.startswith((START, CHANNEL)):
                    self._state = "header"
                elif (START.startswith(text) or CHANNEL.startswith(text)) and not final:
                    self._held = text
                    break
                else:
                    self._state = "plain"
            if self._state == "plain":
                content.append(text)
                break
            if self._state == "header":
                end = text.find(MESSAGE)
                if end == -1:
                    self._held = "" if final else text  # a header cut short says nothing
                    break
                channel = text[:end].split(CHANNEL, 1)[-1].split(" ", 1)[0].split("<|", 1)[0]
                self._reasoning = channel == REASONING_CHANNEL
                self.thought |= self._reasoning
                text, self._state = text[end + len(MESSAGE):], "body"
                continue
            end = text.find(END)
            body = text if end == -1 else text[:end]
            if end == -1 and not final:
                keep = tag_prefix_at_end(body, END)
                body, self._held = body[:len(body) - keep], body[len(body) - keep:]
            (reasoning if self._reasoning else content).append(body)
            if end == -1:
                break
            text, self._state = text[end + len(END):], "header"
        return "".join(reasoning), "".join(content)
