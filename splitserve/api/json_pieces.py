"""Compact JSON text made piece by piece: the same text as one call of the encoder, but with a
long list encoded PIECE elements a call. CPython's C encoder holds the GIL for the whole of one
call (a 20k-token chat body with top-5 logprobs is about 0.3 s of it), so a thread encoding a
large body in one call stops the event loop's thread as surely as encoding it there; between
pieces, the loop's thread gets the GIL back."""
from __future__ import annotations

import json
from collections.abc import Callable

LONG_LIST = 64  # a list longer than this is encoded PIECE elements at a time
PIECE = 32  # elements of a long list per call of the encoder (a token's logprobs: ~15 us at top 5)


def dumps_in_pieces(value, dumps: Callable[[object], str], separators: tuple[str, str] = (",", ":")) -> str:
    """`dumps(value)`, where `dumps` writes one line of JSON with `separators` (item, key) and
    nothing else between tokens (no indent; str keys)."""
    parts: list[str] = []
    _add(value, dumps, separators, parts)
    return "".join(parts)


def json_text(value, in_pieces: bool = False) -> str:
    """`value` as one line of compact JSON, as Starlette's JSONResponse renders it; `in_pieces`:
    the same text, made by `dumps_in_pieces`."""
    return dumps_in_pieces(value, _compact) if in_pieces else _compact(value)


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _add(value, dumps: Callable[[object], str], separators: tuple[str, str], parts: list[str]) -> None:
    item_separator, key_separator = separators
    if isinstance(value, (list, tuple)) and len(value) > LONG_LIST:
        pieces = (dumps(value[start:start + PIECE])[1:-1] for start in range(0, len(value), PIECE))
        parts += ("[", item_separator.join(pieces), "]")
    elif isinstance(value, (list, tuple)):
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(item_separator)
            _add(item, dumps, separators, parts)
        parts.append("]")
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                parts.append(item_separator)
            parts += (dumps(key), key_separator)
            _add(item, dumps, separators, parts)
        parts.append("}")
    else:
        parts.append(dumps(value))
