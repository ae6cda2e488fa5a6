"""Tool calls in chat: the constraint that forces one (`tool_choice` "required" or a named
function), and the parsers that find them in the model's text (vLLM's `--tool-call-parser`):
- `llama3_json`: `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after
  `<|python_tag|>`, several separated by `;`; the whole output is calls, or it is content;
- `hermes` (Qwen2.5, Qwen3, Hermes): each call's JSON between `<tool_call>` and `</tool_call>`,
  after the content the model wrote first, if any;
- `mistral`: after `[TOOL_CALLS]` (a special token: such requests keep special tokens in their
  text), a JSON list of `{"name", "arguments"}` (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B) or
  `name[ARGS]{...}`, one per `[TOOL_CALLS]` (v11 on: Mistral Small 3.2, Devstral), after the
  content written first, if any. Its calls get ids of 9 letters and digits, the only ones
  Mistral's chat templates take back;
- `granite` (Granite 3.x): after `<|tool_call|>` (a special token, kept as Mistral's is), a JSON
  list of `{"name", "arguments"}`, after the content written first, if any;
- `glm45` (GLM-4.5, 4.6): each call between `<tool_call>` and `</tool_call>` (special tokens, kept),
  its function's name on the first line, then `<arg_key>k</arg_key><arg_value>v</arg_value>`
  pairs: a value is the text itself where the function's schema types that parameter a string,
  else the JSON it holds (text that is not JSON stays text), as vLLM's glm45 parser reads them.
A forced call is always the JSON format (the constraint writes it). Text that does not parse as
calls is the assistant's content, as it was written.
"""
from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from splitserve.api import client_json
from splitserve.api.tags import tag_prefix_at_end
from splitserve.engine.output_constraint import OutputConstraint

LLAMA3_JSON, HERMES, MISTRAL, GRANITE, GLM45 = "llama3_json", "hermes", "mistral", "granite", "glm45"
TOOL_CALL_PARSERS = (LLAMA3_JSON, HERMES, MISTRAL, GRANITE, GLM45)
SPECIAL_TAGGED = (MISTRAL, GRANITE, GLM45)  # tags that are special tokens: a chat offering tools keeps those
PYTHON_TAG = "<|python_tag|>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GRANITE_CALLS = "<|tool_call|>"
GLM45_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id(served_parser: str) -> str:
    """A call's id, as the chat template of a model served with `served_parser` takes it back."""
    if served_parser == MISTRAL:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


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


def parse_tool_calls(text: str, names: Collection[str], ids: str = LLAMA3_JSON) -> list[ToolCall] | None:
    """The calls `text` holds (the JSON format), each naming one of `names`; None when it is not
    (only) calls. `ids`: the served parser, whose id shape the calls get (`new_call_id`)."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):  # a model's output nested too deeply is no call either
            return None
        call = _call(value, names, ids)
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return calls or None


def parse_hermes_calls(text: str, names: Collection[str], ids: str = HERMES
                       ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `<tool_call>`, or None if blank; the calls), each naming one
    of `names`; None when there is no call, or what follows the first tag is not only calls. The
    last call's `</tool_call>` may be cut by a stop token."""
    def read(body: str) -> ToolCall | None:
        try:
            return _call(client_json.loads(body), names, ids)
        except ValueError:
            return None

    return _tagged_blocks(text, read, cut_last=True)


def _tagged_blocks(text: str, read, cut_last: bool) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `<tool_call>`, or None if blank; `read` of each block's body
    between `<tool_call>` and `</tool_call>`, where `cut_last` lets the last block go unclosed);
    None when there is no block, a block reads as None, or anything but blocks follows the first."""
    start = text.find(HERMES_OPEN)
    if start == -1:
        return None
    content, rest, calls = text[:start].strip() or None, text[start:], []
    while rest:
        end = rest.find(HERMES_CLOSE)
        if end == -1 and not cut_last:
            return None
        call = read(rest[len(HERMES_OPEN):] if end == -1 else rest[len(HERMES_OPEN):end])
        if call is None:
            return None
        calls.append(call)
        rest = "" if end == -1 else rest[end + len(HERMES_CLOSE):].strip()
        if rest and not rest.startswith(HERMES_OPEN):
            return None
    return content, calls


def parse_mistral_calls(text: str, names: Collection[str], ids: str = MISTRAL
                        ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `[TOOL_CALLS]`, or None if blank; the calls), each naming one
    of `names`; None when there is no call, or what follows the first marker is not only calls."""
    start = text.find(MISTRAL_CALLS)
    if start == -1:
        return None
    content, calls = text[:start].strip() or None, []
    for part in text[start + len(MISTRAL_CALLS):].split(MISTRAL_CALLS):
        values = _mistral_values(part.strip())
        for value in values or [None]:
            call = _call(value, names, ids)
            if call is None:
                return None
            calls.append(call)
    return content, calls


def _mistral_values(part: str) -> list | None:
    """The call objects after one `[TOOL_CALLS]`: a JSON list (or one object) of them, or
    `name[ARGS]{...}` (a `[CALL_ID]...` between the two is the model's, not kept)."""
    if part.startswith(("[", "{")):
        value = _whole_json(part)
        return value if isinstance(value, list) else [value]
    name, marked, arguments = part.partition(MISTRAL_ARGS)
    if not marked:
        return None
    return [{"name": name.partition(MISTRAL_CALL_ID)[0].strip(), "arguments": _whole_json(arguments.strip())}]


def parse_granite_calls(text: str, names: Collection[str], ids: str = GRANITE
                        ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before `<|tool_call|>`, or None if blank; the calls of the JSON list after it),
    each naming one of `names`; None when there is no call, or what follows the tag is not only
    a list of calls."""
    start = text.find(GRANITE_CALLS)
    if start == -1:
        return None
    values = _whole_json(text[start + len(GRANITE_CALLS):].strip())
    calls = [_call(value, names, ids) for value in values] if isinstance(values, list) else []
    if not calls or None in calls:
        return None
    return text[:start].strip() or None, calls


def offered(functions: list[dict]) -> dict[str, frozenset[str]]:
    """The functions a model may call, by name (what every parser checks a call's name against),
    each with its parameters the schema types a string (what the glm45 format writes as text)."""
    def strings(function: dict) -> frozenset[str]:
        properties = (function.get("parameters") or {}).get("properties") or {}
        return frozenset(k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string")

    return {f["name"]: strings(f) for f in functions}


def parse_glm45_calls(text: str, names: Collection[str], ids: str = GLM45
                      ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `<tool_call>`, or None if blank; the calls), each naming one
    of `names` (`offered`'s mapping types the values); None when there is no call, or what follows
    the first tag is not only whole calls."""
    def read(block: str) -> ToolCall | None:
        name, _, body = block.partition("\n")
        name = name.strip()
        strings = names.get(name, frozenset()) if isinstance(names, Mapping) else frozenset()
        pairs, at = {}, 0
        for match in GLM45_ARGUMENT.finditer(body):
            if match.start() != at:
                return None
            key, value = match.group(1).strip(), match.group(2)
            pairs[key] = value if key in strings else _json_or_text(value)
            at = match.end()
        return None if body[at:].strip() else _call({"name": name, "arguments": pairs}, names, ids)

    return _tagged_blocks(text, read, cut_last=False)


def _json_or_text(value: str):
    try:
        return client_json.loads(value)
    except ValueError:
        return value


def _whole_json(text: str):
    """The JSON value `text` is, or None."""
    try:
        return client_json.loads(text)
    except ValueError:
        return None


_TAGGED = {HERMES: (HERMES_OPEN, parse_hermes_calls), MISTRAL: (MISTRAL_CALLS, parse_mistral_calls),
           GRANITE: (GRANITE_CALLS, parse_granite_calls), GLM45: (HERMES_OPEN, parse_glm45_calls)}


def find_tool_calls(text: str, names: Collection[str], parser: str, ids: str | None = None
                    ) -> tuple[str | None, list[ToolCall]] | None:
    """(content alongside, calls) in `parser`'s format; None when `text` is not calls. `ids`: the
    served parser, whose id shape the calls get (default: `parser`)."""
    ids = parser if ids is None else ids
    if parser in _TAGGED:
        return _TAGGED[parser][1](text, names, ids)
    calls = parse_tool_calls(text, names, ids)
    return None if calls is None else (None, calls)


def _call(value, names: Collection[str], ids: str) -> ToolCall | None:
    arguments = value.get("parameters", value.get("arguments")) if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id(ids))


class StreamedCalls:
    """A chat stream with tools offered. JSON format: text that may be calls (it starts with `{`
    or the python tag) is held back until the output ends, then sent as calls if it parses, else as
    content; other text streams as it comes. Tagged formats: content streams until the format's
    tag (`<tool_call>`, `[TOOL_CALLS]`, `<|tool_call|>`; a piece that may end in one waits for the
    next),
    and from the tag on everything is held back until the end, then sent as calls if it parses,
    else as content. `ids`: the served parser, whose id shape the calls get (default: `parser`)."""

    def __init__(self, names: Collection[str], parser: str = LLAMA3_JSON, ids: str | None = None):
        self.names, self.parser, self.ids = names, parser, parser if ids is None else ids
        self._held: list[str] = []
        self._deciding = True  # JSON: whether the output is calls is not known yet; tagged formats: no tag seen

    def feed(self, piece: str, reason: str | None) -> tuple[str, list[ToolCall] | None, str | None] | None:
        """(content, calls, finish reason) to send now, the content before the calls; None: hold
        everything back for now."""
        if self.parser in _TAGGED:
            return self._feed_tagged(piece, reason)
        if not self._deciding:
            return piece, None, reason
        self._held.append(piece)
        text = "".join(self._held)
        verdict = may_be_calls(text)
        if reason is None and verdict is not False:
            return None
        self._deciding, self._held = False, []
        calls = parse_tool_calls(text, self.names, self.ids) if verdict and reason == "stop" else None
        return ("", calls, "tool_calls") if calls else (text, None, reason)

    def _feed_tagged(self, piece: str, reason: str | None):
        tag, parse = _TAGGED[self.parser]
        text = "".join(self._held) + piece
        self._held = []
        before = ""
        if self._deciding:
            start = text.find(tag)
            if start == -1:
                keep = 0 if reason else tag_prefix_at_end(text, tag)
                self._held = [text[len(text) - keep:]] if keep else []
                sent = text[:len(text) - keep]
                return (sent, None, reason) if sent or reason else None
            self._deciding, before, text = False, text[:start], text[start:]
        if reason is None:
            self._held = [text]
            return (before, None, None) if before else None
        found = parse(text, self.names, self.ids) if reason == "stop" else None
        return (before, found[1], "tool_calls") if found else (before + text, None, reason)
