"""What a request's output must match (structured output): a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a Lark grammar. A plain value, checked on
construction; `grammar.py` turns it into token masks.

A reasoning model may think before the constrained answer (vLLM applies structured output after
the reasoning): with `thinking` "open" the output starts inside a thinking (the prompt opened it)
and is free up to the first `</think>`; with "optional" it may begin with a `<think> ... </think>`
of free text. Blanks may follow the thinking; the constraint holds from the next character. With
"harmony" (GPT-OSS's channels, whose markers are special tokens of its tokenizer) the output may
first hold analysis messages of free text, then opens its final message, where the constraint
holds."""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
HARMONY = "harmony"  # GPT-OSS's channels: analysis messages, then the final one
THINKING = ("", "open", "optional", HARMONY)  # "": the constraint holds from the first token
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the tags of the reasoning formats served (DeepSeek-R1, Qwen3)
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused


@dataclass(frozen=True)
class OutputConstraint:
    kind: str
    spec: str = ""  # json_schema: the schema as JSON text; choice: a JSON list of strings; else the pattern
    thinking: str = ""  # one of THINKING

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.thinking not in THINKING:
            raise ValueError(f"constraint thinking must be one of {THINKING}, got {self.thinking!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"constraint {self.kind} must be text of at most {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            _check_json(self.spec, dict, "a JSON schema must be an object")
        elif self.kind == "choice":
            choices = _check_json(self.spec, list, "choice must be a non-empty list of strings")
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"constraint {self.kind} must not be empty")

    @classmethod
    def of(cls, kind: str, value=None) -> OutputConstraint:
        """From a request's value: a schema dict (or JSON text), a choice list, a pattern string."""
        if kind in ("json_schema", "choice") and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return cls(kind, "" if value is None else value)


def _check_json(text: str, kind: type, message: str):
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{message}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{message}: nested too deeply") from None
    if not isinstance(value, kind):
        raise ValueError(message)
    return value
