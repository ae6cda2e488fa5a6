"""Tool calls in chat: the constraint that forces one (`tool_choice` "required" or a named
function), and the parser that finds them in the model's text, in the Llama 3 JSON format:
`{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after `<|python_tag|>`, several
separated by `;`. Text that does not parse as calls is the assistant's content, as it was written.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from splitserve.engine.output_constraint import OutputConstraint

PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`
    id: str

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def forced_call_constraint(functions: list[dict], choice) -> OutputConstraint | None:
    """With `tool_choice` "required" (any of the tools) or naming one function, the output is
    constrained to one call in the Llama 3 JSON format; None when the model chooses ("auto", "none")."""
    if choice in (None, "auto", "none"):
        return None
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": f["name"]}, "parameters": f.get("parameters") or {"type": "object"}}}
             for f in functions]
    return OutputConstraint.of("json_schema", calls[0] if len(calls) == 1 else {"anyOf": calls})


def may_be_calls(text: str) -> bool | None:
    """Whether text starting like this may be tool calls (True), is not (False), or cannot tell
    yet (None: nothing but whitespace, or a prefix of the python tag)."""
    head = text.lstrip()
    if not head or PYTHON_TAG.startswith(head):
        return None
    return head.startswith("{") or head.startswith(PYTHON_TAG)


def parse_tool_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls `text` holds, each naming one of `names`; None when it is not (only) calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        arguments = value.get("parameters", value.get("arguments")) if isinstance(value, dict) else None
        if not isinstance(value, dict) or value.get("name") not in names or not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}"))
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return calls or None


class StreamedCalls:
    """A chat stream with tools offered: text that may be calls (it starts with `{` or the python
    tag) is held back until the output ends, then sent as calls if it parses, else as content;
    other text streams as it comes."""

    def __init__(self, names: set[str]):
        self.names = names
        self._held: list[str] = []
        self._deciding = True

    def feed(self, piece: str, reason: str | None) -> tuple[str, list[ToolCall] | None, str | None] | None:
        """(content, calls, finish reason) to send now; None: hold everything back for now."""
        if not self._deciding:
            return piece, None, reason
        self._held.append(piece)
        text = "".join(self._held)
        verdict = may_be_calls(text)
        if reason is None and verdict is not False:
            return None
        self._deciding, self._held = False, []
        calls = parse_tool_calls(text, self.names) if verdict and reason == "stop" else None
        return ("", calls, "tool_calls") if calls else (text, None, reason)
