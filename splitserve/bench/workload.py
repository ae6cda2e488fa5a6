"""Workloads: which requests a benchmark sends and when, from a trace and a seed.

Arrivals are either the trace's own timestamps (Azure or Mooncake traces: a window of consecutive
rows, optionally rescaled to a mean rate with its burstiness kept) or a renewal process: Poisson
(exponential gaps) or gamma (gaps with a chosen coefficient of variation), the first request at
t = 0. Lengths come from the same trace rows, scaled and clipped. A Mooncake trace's rows also
give each request its prefix-block ids, the blocks scaled with the lengths. A request's LoRA
adapter and its priority class are drawn each from a stream of its own (naming them changes
nothing else). The same spec always gives the same list.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from splitserve.bench.mooncake import conversation_key
from splitserve.bench.traces import TRACE_FILES, TraceData, load_trace, trace_stats

__all__ = ["ARRIVALS", "TRACE_FILES", "RequestSpec", "TraceData", "WorkloadSpec", "load_trace", "make_workload",
           "parse_priorities", "resolved_arrivals", "trace_stats"]

ARRIVALS = ("poisson", "gamma", "trace")
MAX_ADAPTERS = 1024  # adapters a workload names at most (engine.max_cpu_loras' bound)
MAX_PRIORITY_CLASSES = 16
MAX_PRIORITY = 2**31 - 1  # a priority's magnitude at most (SamplingParams')
MAX_LENGTH = 2 ** 62  # the clip without a max_*_tokens: past any real length, and exact as a float and an int64


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int
    arrival_s: float          # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int        # forced: sent as max_tokens with ignore_eos (Splitwise does the same)
    ttft_slo_s: float | None = None   # the request's latency targets (SLO-aware scheduling), if any
    tbt_slo_s: float | None = None
    # The prompt is the first prompt_tokens tokens of these blocks of block_tokens tokens each (equal
    # ids, equal tokens), padded with the request's own tokens past them; no blocks: all its own.
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 0
    priority: int = 0  # sent as the request's `priority` where not 0 (priority scheduling)
    adapter: str | None = None  # the LoRA adapter it names as its `model` (None: the served model)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send. `arrivals=None` picks "trace" for a trace with timestamps when `rate` is None,
    else "poisson". Lengths are round(length * length_scale) (half to even, like Python's round),
    then clipped to [min_tokens, max_*_tokens]; prefix blocks hold max(1, round(block tokens *
    length_scale)) tokens, so a clipped prompt keeps a prefix of its blocks."""

    trace: str                        # "code" | "conv" | "sharegpt" | "arxiv" | "mooncake" | a path | "fixed"
    num_requests: int
    rate: float | None = None         # mean requests/s; None: the trace's own arrivals (traces with timestamps)
    arrivals: str | None = None       # "poisson" | "gamma" | "trace" | None (see above)
    burstiness: float = 1.0           # gamma: coefficient of variation of inter-arrival times (1 = Poisson)
    length_scale: float = 1.0         # multiply prompt and output lengths
    max_prompt_tokens: int | None = None   # clip (the model's context); after scaling
    max_output_tokens: int | None = None
    min_tokens: int = 1               # every length is at least this after scaling
    fixed_prompt_tokens: int = 128    # trace "fixed"
    fixed_output_tokens: int = 128
    seed: int = 0
    start_row: int = 0                # "trace" arrivals: replay rows from here (a window of the real trace)
    session_fraction: float = 1.0     # "trace" arrivals with prefix blocks: keep each conversation (every turn)
                                      # with this probability (by the seed), then take the window of what is kept
    adapters: tuple[str, ...] = ()    # LoRA adapters the requests name, each drawn by its rank's Zipf weight:
    adapter_zipf: float = 0.0         # the k-th (from 0) with probability proportional to 1 / (k + 1) ** adapter_zipf
    priorities: tuple[tuple[int, float], ...] = ()  # (priority, share): each request's class drawn by the shares

    def __post_init__(self):
        _require(self.num_requests >= 1, "num_requests", f"must be at least 1, got {self.num_requests}")
        _require(self.rate is None or _positive(self.rate), "rate", f"must be a positive number, got {self.rate}")
        _require(self.arrivals is None or self.arrivals in ARRIVALS, "arrivals",
                 f"must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        _require(_positive(self.burstiness), "burstiness", f"must be a positive number, got {self.burstiness}")
        _require(_positive(self.length_scale), "length_scale", f"must be a positive number, got {self.length_scale}")
        _require(self.min_tokens >= 1, "min_tokens", f"must be at least 1, got {self.min_tokens}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            _require(value is None or value >= self.min_tokens, name,
                     f"must be at least min_tokens ({self.min_tokens}), got {value}")
        for name in ("fixed_prompt_tokens", "fixed_output_tokens"):
            _require(getattr(self, name) >= 1, name, f"must be at least 1, got {getattr(self, name)}")
        _require(self.start_row >= 0, "start_row", f"must be at least 0, got {self.start_row}")
        _require(0 < self.session_fraction <= 1, "session_fraction",
                 f"must be in (0, 1], got {self.session_fraction}")
        _require(len(self.adapters) <= MAX_ADAPTERS and all(isinstance(a, str) and a for a in self.adapters)
                 and len(set(self.adapters)) == len(self.adapters), "adapters",
                 f"must be at most {MAX_ADAPTERS} distinct non-empty names, got {self.adapters!r:.200}")
        _require(math.isfinite(self.adapter_zipf) and self.adapter_zipf >= 0, "adapter_zipf",
                 f"must be a number >= 0, got {self.adapter_zipf}")
        classes = [p for p, _ in self.priorities]
        _require(len(classes) <= MAX_PRIORITY_CLASSES and len(set(classes)) == len(classes)
                 and all(isinstance(p, int) and abs(p) <= MAX_PRIORITY for p in classes)
                 and all(_positive(share) for _, share in self.priorities), "priorities",
                 f"must be at most {MAX_PRIORITY_CLASSES} distinct integer priorities in [{-MAX_PRIORITY}, "
                 f"{MAX_PRIORITY}], each with a positive share, got {self.priorities!r:.200}")


def _require(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {problem}")


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def make_workload(spec: WorkloadSpec) -> list[RequestSpec]:
    """The requests of `spec`, in arrival order, indexed from 0."""
    trace = _trace_for(spec)
    kind = resolved_arrivals(spec, trace.timestamps_s is not None)
    if kind == "trace":
        rows = _window(spec, _sessions(spec, trace))
        arrivals = _trace_arrivals(trace.timestamps_s[rows], spec.rate)
    else:
        _require(spec.session_fraction == 1, "session_fraction", f"needs 'trace' arrivals, not {kind}")
        rng = np.random.default_rng(spec.seed)
        rows = rng.integers(0, len(trace), size=spec.num_requests)
        arrivals = _renewal_arrivals(rng, kind, spec)
    prompt = _scaled(trace.prompt_tokens[rows], spec, spec.max_prompt_tokens)
    output = _scaled(trace.output_tokens[rows], spec, spec.max_output_tokens)
    blocks, block_tokens = _prefix_blocks(trace, rows, spec)
    adapters, priorities = _adapters(spec, len(rows)), _priorities(spec, len(rows))
    return [RequestSpec(i, float(a), int(p), int(o), prefix_blocks=b, block_tokens=block_tokens, adapter=adapter,
                        priority=priority)
            for i, (a, p, o, b, adapter, priority) in enumerate(zip(arrivals, prompt, output, blocks, adapters,
                                                                      priorities))]


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """`--priority-mix` ("0:0.2,1:0.8": priority 0 for a fifth of the requests, 1 for the rest) as
    (priority, share) pairs; ValueError naming the flag."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        priority, _, share = item.partition(":")
        try:
            pairs.append((int(priority), float(share)))
        except ValueError:  # a share absent ("0") is float("")'s error too
            raise ValueError(f"--priority-mix: {item!r} is not PRIORITY:SHARE (e.g. 0:0.2,1:0.8)") from None
    return tuple(pairs)


def _priorities(spec: WorkloadSpec, count: int) -> list[int]:
    """Each request's priority, drawn by the classes' shares (a stream of its own); 0 without classes."""
    if not spec.priorities:
        return [0] * count
    shares = np.array([share for _, share in spec.priorities])
    picks = np.random.default_rng([spec.seed, 2]).choice(len(shares), size=count, p=shares / shares.sum())
    return [spec.priorities[k][0] for k in picks]


def _adapters(spec: WorkloadSpec, count: int) -> list[str | None]:
    """Each request's adapter (a stream of its own, so naming adapters changes nothing else)."""
    if not spec.adapters:
        return [None] * count
    weights = 1.0 / np.arange(1, len(spec.adapters) + 1) ** spec.adapter_zipf
    picks = np.random.default_rng([spec.seed, 1]).choice(len(spec.adapters), size=count, p=weights / weights.sum())
    return [spec.adapters[k] for k in picks]


def resolved_arrivals(spec: WorkloadSpec, has_timestamps: bool) -> str:
    """The arrival process `spec` asks for, once its trace is known to have timestamps or not."""
    kind = spec.arrivals or ("trace" if spec.rate is None and has_timestamps else "poisson")
    if kind == "trace" and not has_timestamps:
        raise ValueError(f"arrivals: 'trace' needs a trace with timestamps (code, conv, mooncake, an Azure-layout "
                         f"CSV or a Mooncake .jsonl); "
                         f"{spec.trace!r} has none")
    if kind != "trace" and spec.rate is None:
        raise ValueError(f"rate: required for {kind} arrivals (trace {spec.trace!r})")
    return kind


def _trace_for(spec: WorkloadSpec) -> TraceData:
    if spec.trace != "fixed":
        return load_trace(spec.trace)
    return TraceData("fixed", np.array([spec.fixed_prompt_tokens]), np.array([spec.fixed_output_tokens]), None)


def _sessions(spec: WorkloadSpec, trace: TraceData) -> np.ndarray:
    """The trace's rows of the conversations `session_fraction` keeps (all of them at 1), in order.
    Sampling whole conversations keeps their reuse (each turn resends the history), which a window
    of consecutive rows mostly cuts: the turns of a conversation are minutes apart."""
    if spec.session_fraction == 1:
        return np.arange(len(trace))
    _require(trace.prefix_blocks is not None, "session_fraction",
             f"needs a trace with prefix blocks (mooncake or a Mooncake .jsonl); {spec.trace!r} has none")
    rng, kept = np.random.default_rng(spec.seed), {}
    for blocks in trace.prefix_blocks:
        key = conversation_key(blocks)
        if key not in kept:
            kept[key] = rng.random() < spec.session_fraction
    return np.array([i for i, blocks in enumerate(trace.prefix_blocks) if kept[conversation_key(blocks)]],
                    dtype=np.int64)


def _window(spec: WorkloadSpec, rows: np.ndarray) -> np.ndarray:
    end = spec.start_row + spec.num_requests
    if end > len(rows):
        sampled = f" of the sampled conversations (session_fraction={spec.session_fraction})" \
            if spec.session_fraction < 1 else ""
        raise ValueError(f"start_row: rows {spec.start_row}..{end - 1} (num_requests={spec.num_requests}) run past "
                         f"the {len(rows)} rows{sampled} of trace {spec.trace!r}")
    return rows[spec.start_row:end]


def _trace_arrivals(stamps: np.ndarray, rate: float | None) -> np.ndarray:
    """Shift to start at 0; with a rate, stretch so the mean gap is 1 / rate (relative gaps kept)."""
    arrivals = stamps - stamps[0]
    if rate is None or len(arrivals) < 2:
        return arrivals
    mean_gap = arrivals[-1] / (len(arrivals) - 1)
    if mean_gap == 0:
        raise ValueError("rate: every request of this trace window arrives at one instant; it has no rate to scale")
    return arrivals * ((1.0 / rate) / mean_gap)


def _renewal_arrivals(rng: np.random.Generator, kind: str, spec: WorkloadSpec) -> np.ndarray:
    """Arrival times with i.i.d. gaps of mean 1 / rate; gamma gaps have shape 1 / cv^2."""
    mean_gap, num_gaps = 1.0 / spec.rate, spec.num_requests - 1
    if kind == "poisson":
        gaps = rng.exponential(mean_gap, num_gaps)
    else:
        shape = 1.0 / spec.burstiness ** 2
        gaps = rng.gamma(shape, mean_gap / shape, num_gaps)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _prefix_blocks(trace: TraceData, rows: np.ndarray, spec: WorkloadSpec) -> tuple[list[tuple[int, ...]], int]:
    """Each row's prefix-block ids, and the tokens of a block after length_scale (() and 0 without ids)."""
    if trace.prefix_blocks is None:
        return [()] * len(rows), 0
    return [trace.prefix_blocks[row] for row in rows], max(1, round(trace.block_tokens * spec.length_scale))


def _scaled(lengths: np.ndarray, spec: WorkloadSpec, maximum: int | None) -> np.ndarray:
    # clipped as floats: a scaled length past int64 (even inf) must clip to the maximum, not wrap in the cast
    upper = MAX_LENGTH if maximum is None else min(maximum, MAX_LENGTH)
    return np.clip(np.rint(lengths * spec.length_scale), spec.min_tokens, upper).astype(np.int64)
