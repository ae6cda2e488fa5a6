"""GPT-OSS's output in OpenAI's harmony format, told apart into reasoning and answer (vLLM's
`openai_gptoss` reasoning parser). The output (special tokens kept) is a run of messages, each a
header and a body: `[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][<|constrain|>FORMAT]<|message|>`,
then the body up to `<|end|>` (the last one's up to the stop token, which the text leaves out).
The `analysis` channel is the reasoning; `final` and `commentary` (the preamble a model writes
before acting) are the answer. A message addressed `to=functions.NAME` is a tool call, its body
the arguments' JSON: it goes into the answer spelled as a hermes call (`<tool_call>{"name": NAME,
"arguments": BODY}</tool_call>`), which the chat's tool-call reader (`tool_calls`, HERMES) takes
back out. An output that does not open with a header is all answer. (A constrained answer holds
in the final message, after any analysis: `grammar.HARMONY_LARK`.)"""
from __future__ import annotations

import json
import re

from splitserve.api.tags import tag_prefix_at_end
from splitserve.api.tool_calls import HERMES_CLOSE, HERMES_OPEN

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
REASONING_CHANNEL = "analysis"
FUNCTION_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class HarmonySplitter:
    """Text pieces in, (reasoning, content) pieces out, as `reasoning.ReasoningSplitter`: a header,
    or the end of a piece that may begin `<|end|>`, is held until it is whole (or the output ends)."""

    def __init__(self):
        self._state = "start"  # start: may open with a header; header; body; plain: no headers, all answer
        self._reasoning = False  # the body being read is the analysis channel's
        self._call = False  # ... a tool call's arguments (closed as a hermes call at its end)
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
                header = text[:end]
                channel = header.split(CHANNEL, 1)[-1].split(" ", 1)[0].split("<|", 1)[0]
                call = FUNCTION_RECIPIENT.search(header)
                self._reasoning, self._call = channel == REASONING_CHANNEL and call is None, call is not None
                self.thought |= self._reasoning
                if call is not None:
                    content.append(f'{HERMES_OPEN}{{"name": {json.dumps(call.group(1))}, "arguments": ')
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
            self._close_call(content)
        if final:  # a call's last message ends at its stop token (<|call|>), which the text leaves out
            self._close_call(content)
        return "".join(reasoning), "".join(content)

    def _close_call(self, content: list[str]) -> None:
        if self._call:
            content.append("}" + HERMES_CLOSE)
            self._call = False
