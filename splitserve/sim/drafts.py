"""Speculative decoding in the simulator: the engine's own `speculate` gives a step's decodes their
drafts within its limits, and whether each is kept is drawn.

Every decode drafts `num_speculative_tokens` (what the step's limits leave), as a draft model or a
Predicted Outputs workload does; n-gram lookup drafts only where its context repeats, so for it this
is the most checking costs. Each draft is kept, while the ones before it were, with one probability,
`acceptance` (i.i.d. drafts: vLLM's per-position acceptance rates at one rate), which is solved
from `kept_share`: drafts kept over drafts checked, as a cluster's /metrics count them
(`splitserve_spec_decode_accepted_tokens_total` over `..._draft_tokens_total`).

A step's drafts are costed as the performance model costs any mixed batch (the engine runs them as
prefill chunks in the step's forward): the decodes at least their decode time, the drafts chunk
tokens through the weights with them, attending over their decode's context
(`SimWorker.start_iteration`, `PerfModel.iteration_time`). No profile holds a step with drafts, and
Splitwise's prefill curves are flat below their first point (128 tokens): at small batches a step
with drafts costs about such a prefill, likely more than a GPU takes to check a few drafts.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property

from splitserve.engine.sequence import Sequence
from splitserve.engine.speculation import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

_BISECTIONS = 60  # halvings of [0, 1] that pin `acceptance` far below float64's resolution of it


@dataclass(frozen=True)
class DraftModel:
    num_speculative_tokens: int
    kept_share: float  # drafts kept / drafts checked, in [0, 1]

    def __post_init__(self) -> None:
        k, share = self.num_speculative_tokens, self.kept_share
        if not (isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not (isinstance(share, (int, float)) and math.isfinite(share) and 0 <= share <= 1):
            raise ValueError(f"kept_share must be a number in [0, 1], got {share!r}")

    @cached_property
    def acceptance(self) -> float:
        """The chance a draft is kept given the ones before it were: the a in [0, 1] with
        (a + a^2 + ... + a^k) / k = kept_share (the expected share kept of k drafts)."""
        k, low, high = self.num_speculative_tokens, 0.0, 1.0
        for _ in range(_BISECTIONS):
            middle = (low + high) / 2
            if sum(middle ** i for i in range(1, k + 1)) / k < self.kept_share:
                low = middle
            else:
                high = middle
        return (low + high) / 2


class SimDrafts:
    """A worker's drafts: `speculate`'s proposer (every draft the filler token), and the draws of
    how many of a decode's drafts its step keeps, seeded by the worker's name."""

    def __init__(self, model: DraftModel, filler: int, seed: str):
        self.config = SpeculativeConfig(model.num_speculative_tokens, 1, 1)
        self.acceptance, self.filler, self._draw = model.acceptance, filler, random.Random(seed).random

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        return (self.filler,) * limit

    def kept(self, drafted: int) -> int:
        """How many of `drafted` drafts a step keeps: each while the ones before it were."""
        kept = 0
        while kept < drafted and self._draw() < self.acceptance:
            kept += 1
        return kept
