"""Request traces: the five shipped traces by name, or any file in one of their three layouts.

Azure CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): lengths plus real arrival times.
Length CSV (`num_prefill_tokens,num_decode_tokens,...`): lengths only.
Mooncake JSON lines (`.jsonl`, see `mooncake.py`): lengths, arrival times and prefix-block ids.
"""
from __future__ import annotations

import csv
import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.bench.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from splitserve.data import TRACES_DIR

TRACE_FILES = {
    "code": "AzureLLMInferenceTrace_code.csv",
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # how an Azure TIMESTAMP starts (an epoch number does not)
MAX_TOKENS = 2 ** 63 - 1  # token counts fit an int64
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, eq=False)
class TraceData:
    """One trace, row by row. The arrays are read-only (traces are cached and shared)."""

    name: str
    prompt_tokens: np.ndarray           # int64, one per row
    output_tokens: np.ndarray           # int64, one per row
    timestamps_s: np.ndarray | None     # float64 seconds since the first row; None for length-only traces
    # per row, the ids of its prompt's blocks of `block_tokens` tokens (equal ids: equal tokens); None: no ids
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.prompt_tokens)


def trace_path(name_or_path: str) -> Path:
    """The file behind a trace name (`code`, `conv`, `sharegpt`, `arxiv`, `mooncake`) or a path."""
    if name_or_path in TRACE_FILES:
        return TRACES_DIR / TRACE_FILES[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path.resolve()
    if path.suffix in (".csv", ".jsonl") or path.parent != Path("."):
        raise FileNotFoundError(f"trace: no such file {str(path)!r}")
    raise ValueError(f"trace: unknown trace {name_or_path!r}; expected one of {', '.join(TRACE_FILES)}, "
                     "'fixed' (workloads only) or the path of a CSV or Mooncake .jsonl file")


def load_trace(name_or_path: str) -> TraceData:
    """Read a trace by name or path (cached per file)."""
    return _read_trace(str(trace_path(name_or_path)))


@functools.lru_cache(maxsize=16)
def _read_trace(path: str) -> TraceData:
    if path.endswith(".jsonl"):
        return _mooncake_trace(path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            columns = tuple(reader.fieldnames or ())
            rows = list(reader)
        except csv.Error as e:
            raise ValueError(f"trace: {path!r} is not valid CSV ({e})") from None
    if not rows:
        raise ValueError(f"trace: {path!r} has no rows")
    if set(AZURE_COLUMNS) <= set(columns):
        prompt, output = _column(rows, "ContextTokens", path), _column(rows, "GeneratedTokens", path)
        return _frozen(TraceData(Path(path).name, prompt, output, _seconds_since_first(rows, path)))
    if set(LENGTH_COLUMNS) <= set(columns):
        prompt, output = _column(rows, "num_prefill_tokens", path), _column(rows, "num_decode_tokens", path)
        return _frozen(TraceData(Path(path).name, prompt, output, None))
    raise ValueError(f"trace: {path!r} has columns {','.join(columns)}; expected "
                     f"{','.join(AZURE_COLUMNS)} or {','.join(LENGTH_COLUMNS)},...")


def _mooncake_trace(path: str) -> TraceData:
    stamps_ms, prompt, output, hash_ids = zip(*read_mooncake(path))
    if not math.isfinite(stamps_ms[-1] - stamps_ms[0]):
        raise ValueError(f"trace: the timestamps of {path!r} span more milliseconds than a float holds")
    seconds = (np.array(stamps_ms) - stamps_ms[0]) / 1000
    return _frozen(TraceData(Path(path).name, np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64),
                             seconds, hash_ids, MOONCAKE_BLOCK_TOKENS))


def _column(rows: list[dict], column: str, path: str) -> np.ndarray:
    try:
        values = [int(row[column]) for row in rows]
    except (TypeError, ValueError) as e:
        raise ValueError(f"trace: column {column} of {path!r} must hold integers ({e})") from e
    for number, value in enumerate(values, 1):
        if not 0 <= value <= MAX_TOKENS:
            raise ValueError(f"trace: column {column} of {path!r} row {number}: {value} is not a token count "
                             f"(an integer in [0, 2^63))")
    return np.array(values, dtype=np.int64)


def _seconds_since_first(rows: list[dict], path: str) -> np.ndarray:
    cells = [(row["TIMESTAMP"] or "").strip().replace(" ", "T") for row in rows]
    for number, cell in enumerate(cells, 1):
        if not ISO_DATE.match(cell):
            raise ValueError(f"trace: column TIMESTAMP of {path!r} row {number}: {cell!r} is not an ISO date-time "
                             "(YYYY-MM-DD hh:mm:ss)")
    try:
        stamps = np.array(cells, dtype="datetime64[us]")  # years 1 to 9999 (nanoseconds wrap outside 1678-2262)
    except ValueError as e:
        raise ValueError(f"trace: column TIMESTAMP of {path!r} must hold date-times ({e})") from e
    seconds = (stamps - stamps[0]).astype(np.int64) / 1e6
    if np.any(np.diff(seconds) < 0):
        raise ValueError(f"trace: column TIMESTAMP of {path!r} must be in time order")
    return seconds


def _frozen(trace: TraceData) -> TraceData:
    for array in (trace.prompt_tokens, trace.output_tokens, trace.timestamps_s):
        if array is not None:
            array.setflags(write=False)
    return trace


def trace_stats(trace: TraceData) -> dict:
    """p50/p90/p99 of prompt and output lengths, and the mean arrival rate where the trace has
    timestamps (rows - 1 over the time from the first row to the last, i.e. 1 / mean gap)."""
    qs = (50, 90, 99)
    stats = {
        "num_rows": len(trace),
        "prompt_tokens": {f"p{q}": float(v) for q, v in zip(qs, np.percentile(trace.prompt_tokens, qs))},
        "output_tokens": {f"p{q}": float(v) for q, v in zip(qs, np.percentile(trace.output_tokens, qs))},
        "mean_rate_rps": None,
        "repeated_block_fraction": (None if trace.prefix_blocks is None
                                    else repeated_block_fraction(trace.prefix_blocks)),
    }
    if trace.timestamps_s is not None and len(trace) > 1 and trace.timestamps_s[-1] > 0:
        stats["mean_rate_rps"] = (len(trace) - 1) / float(trace.timestamps_s[-1])
    return stats


def repeated_block_fraction(prompts: Iterable[tuple[int, ...]]) -> float:
    """The share of all the prompts' blocks, in order, whose id appeared earlier (what a cache that
    never evicts could reuse), from each prompt's block ids (a trace's rows, or a workload's requests)."""
    seen: set[int] = set()
    total = 0
    for blocks in prompts:
        seen.update(blocks)
        total += len(blocks)
    return (total - len(seen)) / total if total else 0.0
