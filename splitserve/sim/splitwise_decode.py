"""splitwise-sim's iteration-time rule, to reproduce the paper's numbers (not to size a real cluster).

splitwise-sim (the simulator behind Splitwise's provisioning results) reads one token-time curve off
the profile: the median `token_time` over x = prompt_size x batch_size, linear in between and
extrapolated linearly beyond both ends. It times a decode-only iteration at x = the number of
decoding sequences, one token each, whatever their contexts: 64 decodes of 1,000-token contexts cost
what one decode of a 64-token context does. Its unloaded TBT (the SLO reference) reads the same curve
at x = the prompt size. A batch with prompt work costs the prefill curve at prompt tokens + decodes,
times 1.1 when it mixes both.

`PerfModel` instead charges every sequence for its context (the profile's batch sweep at 576-token
contexts, plus the per-token slope): 32 such decodes on an A100 take 1.33x one decode, where
splitwise-sim's rule says 0.95x. That is why A100 token machines batch far less in our simulator.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.sim.perf_model import PerfModel, check_curve, fit_perf_model, medians, profile_setups

MIXED_BATCH_FACTOR = 1.1  # splitwise-sim's cost of mixing prompts and decodes in one iteration


@dataclass(frozen=True)
class SplitwiseSimPerf:
    """`base`'s prefill curve with splitwise-sim's decode rule (see the module docstring)."""

    base: PerfModel
    batch_tokens: tuple[float, ...]  # prompt_size x batch_size of the profile's rows (increasing)
    token_ms: tuple[float, ...]      # median token_time at each

    def __post_init__(self) -> None:
        check_curve("batch_tokens", self.batch_tokens, "token_ms", self.token_ms)
        if len(self.batch_tokens) < 2:
            raise ValueError("batch_tokens needs at least two points to extrapolate")

    @property
    def hardware(self) -> str:
        return self.base.hardware

    def prefill_time(self, num_tokens: int) -> float:
        return self.base.prefill_time(num_tokens)

    def decode_time(self, batch_size: int, context_tokens: float) -> float:
        """The token curve at `batch_size` tokens; `context_tokens` is ignored, as splitwise-sim does."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        return self._token_curve(batch_size)

    def lone_decode_time(self, context_tokens: float) -> float:
        """The unloaded TBT of a request with `context_tokens` of prompt: the curve at that size."""
        return self._token_curve(context_tokens)

    def iteration_time(self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int,
                       chunk_context: int = 0) -> float:
        """As splitwise-sim: contexts (the decodes' and the chunks') are ignored."""
        if prefill_tokens < 0 or decode_seqs < 0:
            raise ValueError(f"prefill_tokens and decode_seqs must be >= 0, got {prefill_tokens!r}, {decode_seqs!r}")
        if not prefill_tokens:
            return self.decode_time(decode_seqs, 0.0) if decode_seqs else 0.0
        return self.prefill_time(prefill_tokens + decode_seqs) * (MIXED_BATCH_FACTOR if decode_seqs else 1.0)

    def _token_curve(self, x: float) -> float:
        xs, ys = self.batch_tokens, self.token_ms
        if xs[0] <= x <= xs[-1]:
            ms = float(np.interp(x, xs, ys))
        else:
            i = 0 if x < xs[0] else -2
            ms = ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (x - xs[i])
        if ms <= 0:
            raise ValueError(f"the token curve of {self.hardware} extrapolates to {ms:.3f} ms at {x} tokens")
        return ms / 1000


def load_splitwise_sim_models(path: str | Path | None = None) -> dict[tuple[str, str, int], SplitwiseSimPerf]:
    """One `SplitwiseSimPerf` per (model, hardware, tensor_parallel) of a profile CSV (outliers left out)."""
    return {key: SplitwiseSimPerf(fit_perf_model(key, group), *_token_curve(group))
            for key, group in profile_setups(path).items()}


def _token_curve(rows: list) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """splitwise-sim's token curve: median token_time over prompt_size x batch_size."""
    return medians(rows, lambda r: r.prompt_size * r.batch_size, lambda r: r.token_time)
