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
  else the JSON it holds (text that is not JSON stays text), as vLLM's glm45 parser reads them;
- `minimax_m2` (MiniMax-M2): `<minimax:tool_call>` blocks (kept as special tokens), each of one or
  more `<invoke name="f">` holding `<parameter name="k">v</parameter>`s: a value is typed by the
  function's schema as MiniMax's guide reads it (strings, and parameters it does not type, text;
  integers, numbers and booleans converted, text where they do not parse; objects, arrays and
  other types the JSON they hold, else text; `null` none);
- `qwen3_coder` (Qwen3-Coder): each call between `<tool_call>` and `</tool_call>`, a
  `<function=f>` holding `<parameter=k>` v `</parameter>`s, after the content written first, if
  any: a value loses the newline the format writes on each side of it (its other blanks kept: code
  keeps its indentation) and is typed as minimax_m2's are;
- `seed_oss` (Seed-OSS): qwen3_coder's calls between `<seed:tool_call>` and `</seed:tool_call>`
  (kept as special tokens, as Mistral's are).
A forced call is always the JSON format (the constraint writes it). Text that does not parse as
calls is the assistant's content, as it was written.
"""
from __future__ import annotations

import json
import math
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
MINIMAX_M2, QWEN3_CODER, SEED_OSS = "minimax_m2", "qwen3_coder", "seed_oss"
TOOL_CALL_PARSERS = (LLAMA3_JSON, HERMES, MISTRAL, GRANITE, GLM45, MINIMAX_M2, QWEN3_CODER, SEED_OSS)
# the formats whose tags are special tokens: a chat offering tools keeps special tokens in its text
SPECIAL_TAGGED = (MISTRAL, GRANITE, GLM45, MINIMAX_M2, SEED_OSS)
PYTHON_TAG = "<|python_tag|>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GRANITE_CALLS = "<|tool_call|>"
GLM45_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
MINIMAX_INVOKE = re.compile(r"\s*<invoke name=([^>]*)>(.*?)</invoke>", re.DOTALL)
MINIMAX_PARAMETER = re.compile(r"\s*<parameter name=([^>]*)>(.*?)</parameter>", re.DOTALL)
QWEN3_CODER_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*?)</function>", re.DOTALL)
QWEN3_CODER_PARAMETER = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
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
    def read(body: str) -> list[ToolCall] | None:
        try:
            call = _call(client_json.loads(body), names, ids)
        except ValueError:
            return None
        return None if call is None else [call]

    return _tagged_blocks(text, read, cut_last=True)


def _tagged_blocks(text: str, read, cut_last: bool, tags: tuple[str, str] = (HERMES_OPEN, HERMES_CLOSE)
                   ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first opening tag, or None if blank; the calls `read` finds in each
    block's body between the `tags`, where `cut_last` lets the last block go unclosed); None when
    there is no block, a block reads as None, or anything but blocks follows the first."""
    opening, closing = tags
    start = text.find(opening)
    if start == -1:
        return None
    content, rest, calls = text[:start].strip() or None, text[start:], []
    while rest:
        end = rest.find(closing)
        if end == -1 and not cut_last:
            return None
        found = read(rest[len(opening):] if end == -1 else rest[len(opening):end])
        if found is None:
            return None
        calls += found
        rest = "" if end == -1 else rest[end + len(closing):].strip()
        if rest and not rest.startswith(opening):
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


def offered(functions: list[dict]) -> dict[str, dict[str, str]]:
    """The functions a model may call, by name (what every parser checks a call's name against),
    each with the type its schema gives each parameter, where it names one (of a list, the first
    but "null": an optional value's), what the formats that write values as text (glm45,
    minimax_m2, qwen3_coder, seed_oss) read them by."""
    def kind(schema) -> str | None:
        named = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(named, list):
            named = next((t for t in named if t != "null"), None)
        return named if isinstance(named, str) else None

    def types(function: dict) -> dict[str, str]:
        properties = (function.get("parameters") or {}).get("properties") or {}
        return {k: kind(v) for k, v in properties.items() if kind(v) is not None}

    return {f["name"]: types(f) for f in functions}


def _parameter_types(names: Collection[str], function: str) -> Mapping[str, str]:
    return names.get(function, {}) if isinstance(names, Mapping) else {}


def parse_glm45_calls(text: str, names: Collection[str], ids: str = GLM45
                      ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `<tool_call>`, or None if blank; the calls), each naming one
    of `names` (`offered`'s mapping types the values); None when there is no call, or what follows
    the first tag is not only whole calls."""
    def read(block: str) -> list[ToolCall] | None:
        name, _, body = block.partition("\n")
        name = name.strip()
        types = _parameter_types(names, name)
        pairs = _matches(GLM45_ARGUMENT, body)
        call = None if pairs is None else _call(
            {"name": name, "arguments": {k: v if types.get(k) == "string" else _json_or_text(v) for k, v in pairs}},
            names, ids)
        return None if call is None else [call]

    return _tagged_blocks(text, read, cut_last=False)


def parse_minimax_calls(text: str, names: Collection[str], ids: str = MINIMAX_M2
                        ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first `<minimax:tool_call>`, or None if blank; the calls of every
    `<invoke>` in its blocks), each naming one of `names` (`offered`'s mapping types the values);
    None when there is no call, or what follows the first tag is not only whole blocks of calls."""
    def read(block: str) -> list[ToolCall] | None:
        return _xml_calls(block, MINIMAX_INVOKE, MINIMAX_PARAMETER, str.strip, names, ids)

    return _tagged_blocks(text, read, cut_last=False, tags=(MINIMAX_OPEN, MINIMAX_CLOSE))


def parse_qwen3_coder_calls(text: str, names: Collection[str], ids: str = QWEN3_CODER,
                            tags: tuple[str, str] = (HERMES_OPEN, HERMES_CLOSE)
                            ) -> tuple[str | None, list[ToolCall]] | None:
    """(the content before the first opening tag (`<tool_call>`; Seed-OSS's `<seed:tool_call>`), or
    None if blank; the calls of every `<function=...>` in its blocks), each naming one of `names`
    (`offered`'s mapping types the values); None when there is no call, or what follows the first
    tag is not only whole calls."""
    def read(block: str) -> list[ToolCall] | None:
        return _xml_calls(block, QWEN3_CODER_FUNCTION, QWEN3_CODER_PARAMETER, _unwrapped, names, ids)

    return _tagged_blocks(text, read, cut_last=False, tags=tags)


def parse_seed_oss_calls(text: str, names: Collection[str], ids: str = SEED_OSS
                         ) -> tuple[str | None, list[ToolCall]] | None:
    return parse_qwen3_coder_calls(text, names, ids, (SEED_OPEN, SEED_CLOSE))


def _unwrapped(value: str) -> str:
    """A qwen3_coder value without the newline its format writes on each side of it."""
    return value.removeprefix("\n").removesuffix("\n")


def _xml_calls(block: str, function: re.Pattern, parameter: re.Pattern, clean, names: Collection[str],
               ids: str) -> list[ToolCall] | None:
    """The calls of a block of `function` tags (name, body) each holding only `parameter` tags
    (key, value), the values `clean`ed and typed by the schema (`_typed`); None where the block
    holds anything else, no call, or a call to a function not offered."""
    calls = []
    for name, body in _matches(function, block, unquote=True) or [("", None)]:
        types = _parameter_types(names, name)
        pairs = None if body is None else _matches(parameter, body, unquote=True)
        call = None if pairs is None else _call(
            {"name": name, "arguments": {k: _typed(clean(v), types.get(k)) for k, v in pairs}}, names, ids)
        if call is None:
            return None
        calls.append(call)
    return calls


def _matches(pattern: re.Pattern, body: str, unquote: bool = False) -> list[tuple[str, str]] | None:
    """The (key, text) of `pattern`'s matches, which must follow each other through the whole of
    `body` (blanks between); None where anything else is in it. `unquote`: a key may stand in
    double or single quotes."""
    found, at = [], 0
    for match in pattern.finditer(body):
        if match.start() != at:
            return None
        key = match.group(1).strip()
        if unquote and len(key) > 1 and key[0] == key[-1] and key[0] in "\"'":
            key = key[1:-1]
        found.append((key, match.group(2)))
        at = match.end()
    return None if body[at:].strip() else found


def _typed(value: str, kind: str | None):
    """A minimax_m2, qwen3_coder or seed_oss parameter's text as its schema's `kind` types it
    (MiniMax's guide's rules)."""
    if value.lower() == "null":
        return None
    kind = (kind or "string").lower()
    if kind in ("string", "str", "text"):
        return value
    if kind in ("boolean", "bool"):
        return value.lower() in ("true", "1")
    if kind in ("integer", "int"):
        try:
            return int(value)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):  # JSON has no infinity nor NaN
            return value
        return int(number) if number == int(number) else number
    return _json_or_text(value)


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
           GRANITE: (GRANITE_CALLS, parse_granite_calls), GLM45: (HERMES_OPEN, parse_glm45_calls),
           MINIMAX_M2: (MINIMAX_OPEN, parse_minimax_calls), QWEN3_CODER: (HERMES_OPEN, parse_qwen3_coder_calls),
           SEED_OSS: (SEED_OPEN, parse_seed_oss_calls)}


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
