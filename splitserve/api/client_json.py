"""JSON text the server did not write (a request body, a batch file's line, a tool call's
arguments, a model's tool calls), read so that every problem is a `ValueError` its caller refuses
the input with, and goes on:

- nesting deeper than Python's recursion limit (about 1,000 levels) raises `RecursionError` in
  `json.loads`;
- a `\\ud800`-`\\udfff` escape without its pair decodes to a lone surrogate, a string no UTF-8
  response (an error message naming the value included) can carry.
"""
from __future__ import annotations

import json
import re

# A surrogate can only arrive escaped: UTF-8 cannot encode one, and invalid UTF-8 fails to parse.
_SURROGATE_ESCAPE = {bytes: re.compile(rb"\\u[dD][89a-fA-F]"), str: re.compile(r"\\u[dD][89a-fA-F]")}


def loads(text: str | bytes):
    try:
        value = json.loads(text)
        unicode = not _SURROGATE_ESCAPE[type(text)].search(text) or _is_unicode(value)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not unicode:
        raise ValueError("a \\ud800-\\udfff escape without its pair (a lone surrogate) is not Unicode text")
    return value


def _is_unicode(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True
