"""Mooncake's trace layout: JSON lines `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`, where each hash id names one 512-token block of the prompt (the last block may
be partial) and equal ids are equal blocks, so requests with the same leading ids share a prefix.

Every line is checked; an error names the file, the line and the field. The input is bounded: at
most MAX_FILE_BYTES in all and MAX_LINE_BYTES a line.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

MOONCAKE_BLOCK_TOKENS = 512
MAX_FILE_BYTES = 256 << 20   # 85 times the shipped hour of conversations
MAX_LINE_BYTES = 1 << 20     # about 100,000 hash ids, 50M tokens of prompt
MAX_HASH_ID = 2 ** 63 - 1    # ids fit an int64
MAX_LENGTH = 2 ** 63 - 1     # so do lengths
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

MooncakeRow = tuple[float, int, int, tuple[int, ...]]  # (timestamp ms, input, output, hash ids)
CONVERSATION_BLOCKS = 2  # Mooncake's conversation trace opens every prompt with one shared block (a system
                         # prompt); the next names the conversation, whose later turns resend it


def conversation_key(hash_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The conversation a request belongs to: its first CONVERSATION_BLOCKS block ids."""
    return hash_ids[:CONVERSATION_BLOCKS]


def read_mooncake(path: str) -> list[MooncakeRow]:
    """The rows of a Mooncake trace file, in file order (timestamps never decrease)."""
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise ValueError(f"trace: {path!r} is larger than {MAX_FILE_BYTES >> 20} MiB")
    rows: list[MooncakeRow] = []
    for number, line in _lines(path):
        row = _row(line, f"trace: {path!r} line {number}")
        if rows and row[0] < rows[-1][0]:
            raise ValueError(f"trace: {path!r} line {number}: timestamp {row[0]} is before the previous "
                             f"line's {rows[-1][0]}; the lines must be in time order")
        rows.append(row)
    if not rows:
        raise ValueError(f"trace: {path!r} has no rows")
    return rows


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every non-blank line, each at most MAX_LINE_BYTES."""
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"trace: {path!r} line {number} is longer than {MAX_LINE_BYTES} bytes")
            if line.strip():
                yield number, line


def _row(line: bytes, where: str) -> MooncakeRow:
    try:
        fields = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: not a JSON object")
    missing = [name for name in FIELDS if name not in fields]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]}")
    stamp, prompt, output, hash_ids = (fields[name] for name in FIELDS)
    if not (_is_number(stamp) and math.isfinite(stamp)):
        raise ValueError(f"{where}: timestamp must be a number of milliseconds, got {stamp!r}")
    for name, length in (("input_length", prompt), ("output_length", output)):
        if not (_is_int(length) and 0 <= length <= MAX_LENGTH):
            raise ValueError(f"{where}: {name} must be a non-negative integer below 2^63, got {length!r}")
    if not (isinstance(hash_ids, list) and all(_is_int(h) and 0 <= h <= MAX_HASH_ID for h in hash_ids)):
        raise ValueError(f"{where}: hash_ids must be a list of integers in [0, 2^63)")
    blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise ValueError(f"{where}: input_length {prompt} needs {blocks} hash_ids (one per "
                         f"{MOONCAKE_BLOCK_TOKENS}-token block), got {len(hash_ids)}")
    return float(stamp), prompt, output, tuple(hash_ids)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
