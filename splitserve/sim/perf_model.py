"""Performance models (Splitwise V-B): how long one engine iteration takes on one machine.

Fitted from latency profiles in the Splitwise simulator's CSV format (the packaged A100 / H100 /
power-capped H100 profiles, or this project's engine measured by `splitserve profile`). Each
profile holds one-dimensional sweeps around a reference point (prompt 512, batch 1, output 128 in
the Splitwise data): prompt sizes at batch 1, batch sizes at the reference prompt, output sizes.

- Prefill: piecewise linear in the tokens of the batch (prompt_size x batch_size), the median of
  `prompt_time` over the rows with that many tokens (both sweeps pooled).
- Decode: piecewise linear in the batch size at the reference context (median `token_time` of the
  batch sweep), plus a linear term in context fitted on the prompt sweep's batch-1 `token_time`.
- Prefill chunks: a chunk of n prompt tokens after c tokens already computed (chunked prefill, or a
  prefix-cache hit) attends over them too, so it costs the prefill curve at n plus a slope per
  (chunk token x context token). The slope is fitted on rows with the optional `prefix_size` column
  (`splitserve profile` writes them; the Splitwise profiles have none, so their slope is 0).

Pure Python and numpy, so the simulator never imports torch.
"""
from __future__ import annotations

import csv
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import numpy as np

CSV_COLUMNS = ("model", "hardware", "prompt_size", "batch_size", "token_size", "peak_power", "average_power",
               "prompt_time", "token_time", "e2e_time", "tensor_parallel")
PREFIX_COLUMN = "prefix_size"  # optional: prompt tokens already computed (cached) before the row's prefill
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "data" / "profiles" / "perf_model.csv"
# A row is a failed measurement when its own end-to-end time is this many times what its prompt and
# token times add up to (the llama2-70b TP2 batch-64 rows: 14-17x; every other row: at most 1.2x).
OUTLIER_FACTOR = 5.0
MIN_DECODE_FRACTION = 0.5  # a short context never makes decode faster than this share of the batch curve


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_bytes_per_token: int
    # the engine's KV layer groups (engine/kv_groups.py): each one's window (None: the whole
    # context), and the share of a token's KV bytes a block of one group holds (its layers, padding
    # included, over all the model's: 1 with one group)
    kv_windows: tuple[int | None, ...] = (None,)
    kv_group_share: float = 1.0
    kv_layer_groups: tuple[int, ...] = ()  # per layer: its group (): one group of every layer
    kv_heads: int | None = None  # a token's KV heads, which TP ranks split (None: more than any TP)


def _sim_shape(num_layers: int, hidden_size: int, dtype_bytes: int = 2) -> ModelShape:
    """As the Splitwise simulator sizes KV: 2 (K and V) x hidden x layers x dtype (no GQA)."""
    return ModelShape(num_layers, 2 * hidden_size * num_layers * dtype_bytes)


MODEL_SHAPES = {"llama2-70b": _sim_shape(80, 8192), "bloom-176b": _sim_shape(70, 14336)}
KV_BYTES_PER_TOKEN = {name: shape.kv_bytes_per_token for name, shape in MODEL_SHAPES.items()}


@dataclass(frozen=True)
class PerfModel:
    model: str
    hardware: str
    tensor_parallel: int
    prefill_tokens: tuple[float, ...]   # tokens in a prefill batch (increasing)
    prefill_ms: tuple[float, ...]       # its iteration time
    decode_batch: tuple[float, ...]     # sequences in a decode batch (increasing)
    decode_ms: tuple[float, ...]        # its iteration time at reference_context
    reference_context: float            # mean context (tokens per sequence) of the batch sweep's decodes
    decode_context_slope_ms: float      # extra decode ms per context token in the batch beyond the reference
    chunk_context_slope_ms: float = 0.0  # extra prefill ms per (chunk token x context token before the chunk)

    def __post_init__(self) -> None:
        check_curve("prefill_tokens", self.prefill_tokens, "prefill_ms", self.prefill_ms)
        check_curve("decode_batch", self.decode_batch, "decode_ms", self.decode_ms)
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel!r}")
        if not (math.isfinite(self.reference_context) and self.reference_context >= 0):
            raise ValueError(f"reference_context must be a finite number >= 0, got {self.reference_context!r}")
        for name in ("decode_context_slope_ms", "chunk_context_slope_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds for a prefill iteration over `num_tokens` tokens (all its prompts together).
        Linear between profiled points; flat below the first (small batches are bound by reading
        the weights); the last segment's slope above the last (never decreasing)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
        return _curve(self.prefill_tokens, self.prefill_ms, num_tokens) / 1000

    def decode_time(self, batch_size: int, context_tokens: float) -> float:
        """Seconds for a decode iteration of `batch_size` sequences with mean context
        `context_tokens`: the batch curve, plus the slope for every context token the batch holds
        beyond the reference (each sequence reads its own KV), at least half the batch curve."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        base = _curve(self.decode_batch, self.decode_ms, batch_size)
        extra = self.decode_context_slope_ms * batch_size * (context_tokens - self.reference_context)
        return max(base + extra, MIN_DECODE_FRACTION * base) / 1000

    def lone_decode_time(self, context_tokens: float) -> float:
        """Seconds for one sequence's decode at `context_tokens` alone: the unloaded TBT."""
        return self.decode_time(1, context_tokens)

    def iteration_time(self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int,
                       chunk_context: int = 0) -> float:
        """Seconds for one engine iteration: `prefill_tokens` prompt tokens (whole or chunked),
        `chunk_context` the sum over its prefill chunks of chunk tokens x tokens computed before the
        chunk, and `decode_seqs` decodes whose contexts add up to `decode_context_tokens`.

        Decode only: decode_time at the mean context. With prefill work (a mixed batch), each
        decode rides along as one more token through the weights, prefill_time(prefill_tokens +
        decode_seqs), as in splitwise-sim (which adds 10 % to mixed batches instead of the terms
        that follow), plus the chunks' context term, plus the decodes' attention over their own
        contexts (the decode context slope per token); but never less than the decodes alone, so
        adding a prompt chunk cannot speed an iteration up."""
        if prefill_tokens < 0 or decode_seqs < 0 or chunk_context < 0:
            raise ValueError(f"prefill_tokens, decode_seqs and chunk_context must be >= 0, "
                             f"got {prefill_tokens!r}, {decode_seqs!r}, {chunk_context!r}")
        decode = self.decode_time(decode_seqs, decode_context_tokens / decode_seqs) if decode_seqs else 0.0
        if not prefill_tokens:
            return decode
        attention = (self.chunk_context_slope_ms * chunk_context
                     + self.decode_context_slope_ms * decode_context_tokens) / 1000
        return max(self.prefill_time(prefill_tokens + decode_seqs) + attention, decode)

    def scaled(self, prefill_factor: float, decode_factor: float, hardware: str) -> PerfModel:
        """The same model with prefill and decode times multiplied (e.g. a power cap: 1.3, 1.0)."""
        for name, factor in (("prefill_factor", prefill_factor), ("decode_factor", decode_factor)):
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {factor!r}")
        return replace(self, hardware=hardware, prefill_ms=tuple(t * prefill_factor for t in self.prefill_ms),
                       decode_ms=tuple(t * decode_factor for t in self.decode_ms),
                       decode_context_slope_ms=self.decode_context_slope_ms * decode_factor,
                       chunk_context_slope_ms=self.chunk_context_slope_ms * prefill_factor)


def constant_model(prefill_ms_per_token: float, decode_ms: float, hardware: str = "const",
                   model: str = "const") -> PerfModel:
    """Prefill costs `prefill_ms_per_token` per token, a decode iteration `decode_ms` at any
    batch size and context: timelines one can compute by hand."""
    for name, value in (("prefill_ms_per_token", prefill_ms_per_token), ("decode_ms", decode_ms)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return PerfModel(model, hardware, 1, (1.0, 2.0), (prefill_ms_per_token, 2 * prefill_ms_per_token),
                     (1.0, 2.0), (decode_ms, decode_ms), 0.0, 0.0)


@dataclass(frozen=True)
class ProfileRow:
    model: str
    hardware: str
    tensor_parallel: int
    prompt_size: int
    batch_size: int
    token_size: int
    prompt_time: float  # ms
    token_time: float   # ms
    e2e_time: float     # ms
    prefix_size: int = 0  # prompt tokens already computed before this prefill (a chunk's context)

    @property
    def is_outlier(self) -> bool:
        return self.e2e_time > OUTLIER_FACTOR * (self.prompt_time + (self.token_size - 1) * self.token_time)


@dataclass(frozen=True)
class LoadReport:
    path: str
    num_rows: int
    dropped: tuple[ProfileRow, ...]  # the outlier rows left out of the fit


def load_perf_models(path: str | Path | None = None) -> dict[tuple[str, str, int], PerfModel]:
    """Fit one model per (model, hardware, tensor_parallel) of a profile CSV (default: the
    packaged Splitwise profiles), leaving out outlier rows (see `load_report`)."""
    return {key: fit_perf_model(key, group) for key, group in profile_setups(path).items()}


def profile_setups(path: str | Path | None = None) -> dict[tuple[str, str, int], list[ProfileRow]]:
    """A profile's rows by (model, hardware, tensor_parallel), outliers left out."""
    setups: dict[tuple[str, str, int], list[ProfileRow]] = defaultdict(list)
    for row in read_profile(path):
        if not row.is_outlier:
            setups[row.model, row.hardware, row.tensor_parallel].append(row)
    return setups


def load_report(path: str | Path | None = None) -> LoadReport:
    """How many rows a profile has and which ones `load_perf_models` leaves out."""
    rows = read_profile(path)
    return LoadReport(str(path or DEFAULT_PROFILE), len(rows), tuple(row for row in rows if row.is_outlier))


def read_profile(path: str | Path | None = None) -> list[ProfileRow]:
    path = Path(path or DEFAULT_PROFILE)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(missing)}")
        try:
            return [_parse_row(raw, f"{path} line {reader.line_num}") for raw in reader]
        except csv.Error as e:
            raise ValueError(f"{path}: not valid CSV ({e})") from None


def _parse_row(raw: dict, where: str) -> ProfileRow:
    values = {}
    for name in ProfileRow.__dataclass_fields__:
        if name == PREFIX_COLUMN and raw.get(name) in (None, ""):
            continue  # optional (absent from the Splitwise profiles): 0
        kind = ProfileRow.__dataclass_fields__[name].type
        try:
            values[name] = raw[name] if kind == "str" else (int if kind == "int" else float)(raw[name])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: column {name} must be {kind}, got {raw[name]!r}") from None
    row = ProfileRow(**values)
    if min(row.tensor_parallel, row.prompt_size, row.batch_size, row.token_size) < 1:
        raise ValueError(f"{where}: tensor_parallel, prompt_size, batch_size and token_size must be >= 1")
    if row.prefix_size < 0:
        raise ValueError(f"{where}: prefix_size must be >= 0")
    if not all(math.isfinite(t) and t > 0 for t in (row.prompt_time, row.token_time)):
        raise ValueError(f"{where}: prompt_time and token_time must be positive numbers of ms")
    return row


def fit_perf_model(key: tuple[str, str, int], rows: list[ProfileRow]) -> PerfModel:
    """The reference point is the most common output size and, at that size, the most common
    prompt size (the point every sweep shares). Rows with a prefix only fit the chunk slope."""
    chunks = [r for r in rows if r.prefix_size]
    rows = [r for r in rows if not r.prefix_size]
    if not rows:
        raise ValueError(f"{key}: every row has a prefix_size; the prompt and batch sweeps need prefix_size 0")
    ref_tokens = Counter(r.token_size for r in rows).most_common(1)[0][0]
    at_ref_tokens = [r for r in rows if r.token_size == ref_tokens]
    ref_prompt = max(Counter(r.prompt_size for r in at_ref_tokens).items(), key=lambda kv: (kv[1], kv[0]))[0]
    prefill = medians(rows, lambda r: r.prompt_size * r.batch_size, lambda r: r.prompt_time)
    decode = medians([r for r in at_ref_tokens if r.prompt_size == ref_prompt],
                      lambda r: r.batch_size, lambda r: r.token_time)
    # batch 1 decodes of the prompt sweep, against their mean context (prompt + half the output)
    by_context = medians([r for r in at_ref_tokens if r.batch_size == 1],
                          lambda r: r.prompt_size + ref_tokens / 2, lambda r: r.token_time)
    slope = float(np.polyfit(*by_context, 1)[0]) if len(by_context[0]) > 1 else 0.0
    model = PerfModel(*key, *prefill, *decode, ref_prompt + ref_tokens / 2, max(slope, 0.0))
    return replace(model, chunk_context_slope_ms=chunk_slope(model, chunks)) if chunks else model


def chunk_slope(model: PerfModel, chunks: list[ProfileRow]) -> float:
    """Least squares through the origin: a chunk's time beyond the prefill curve at its tokens,
    against its (chunk tokens x context tokens)."""
    xs = [r.prompt_size * r.batch_size * r.prefix_size for r in chunks]
    extra = [r.prompt_time - model.prefill_time(r.prompt_size * r.batch_size) * 1000 for r in chunks]
    return max(sum(x * y for x, y in zip(xs, extra)) / sum(x * x for x in xs), 0.0)


def medians(rows: list[ProfileRow], x, y) -> tuple[tuple[float, ...], tuple[float, ...]]:
    groups: dict[float, list[float]] = defaultdict(list)
    for row in rows:
        groups[float(x(row))].append(y(row))
    xs = tuple(sorted(groups))
    return xs, tuple(float(statistics.median(groups[v])) for v in xs)


def _curve(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[-1] or len(xs) == 1:
        return float(np.interp(x, xs, ys))
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return ys[-1] + slope * (x - xs[-1])


def check_curve(x_name: str, xs: tuple[float, ...], y_name: str, ys: tuple[float, ...]) -> None:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"{x_name} and {y_name} must be non-empty and of equal length, got {len(xs)} and {len(ys)}")
    if xs[0] <= 0 or any(b <= a for a, b in pairwise(xs)):
        raise ValueError(f"{x_name} must be positive and strictly increasing, got {xs!r}")
    if not all(math.isfinite(y) and y > 0 for y in ys):
        raise ValueError(f"{y_name} must be positive finite times (ms), got {ys!r}")
