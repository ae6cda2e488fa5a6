"""What a policy hands the model runner for one iteration."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.engine.outputs import StepStats
from splitserve.engine.sequence import Sequence


class _ScheduledFields(NamedTuple):
    seq: Sequence
    num_new_tokens: int
    start: int
    samples: bool
    drafts: tuple[int, ...]


class ScheduledSeq(_ScheduledFields):
    """Compute `(seq.token_ids + drafts)[start : start + num_new_tokens]`; sample a token iff that
    reaches the end, and one more for each of the `drafts` (a decode's speculated tokens: `speculation`).
    Built as `ScheduledSeq(seq, num_new_tokens)`, or `ScheduledSeq(seq, 1 + len(drafts), drafts)`.
    Immutable, and a tuple rather than a frozen dataclass: one is built per sequence per iteration,
    and a tuple costs half as much."""

    __slots__ = ()

    def __new__(cls, seq: Sequence, num_new_tokens: int, drafts: tuple[int, ...] = ()) -> ScheduledSeq:
        start = seq.num_computed_tokens
        samples = start + num_new_tokens - len(drafts) == len(seq.token_ids)
        return tuple.__new__(cls, (seq, num_new_tokens, start, samples, drafts))

    def __getnewargs__(self) -> tuple[Sequence, int, tuple[int, ...]]:  # copy and pickle rebuild it through __new__
        return self.seq, self.num_new_tokens, self.drafts


@dataclass(frozen=True)
class Plan:
    scheduled: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    def work(self) -> StepStats:
        """What the plan computes (no time yet), in one pass. Call it before the step runs: the
        step turns finished prefills into decodes."""
        prefill = decodes = context = pairs = chunk_context = drafts = 0
        for item in self.scheduled:
            n = item.num_new_tokens
            if item.seq.is_decoding:  # with drafts: each a query over the context, as a decode's token is
                decodes, context = decodes + n, context + n * item.start + n * (n + 1) // 2
                drafts += len(item.drafts)
            else:
                prefill, pairs = prefill + n, pairs + n * (2 * item.start + n)
                chunk_context += n * item.start
        return StepStats(prefill, decodes, 0.0, context, pairs, chunk_context, drafts)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(frozen=True)
class SLOOptions:
    """The SLO-aware (AccelGen) policy's settings. The latency model is linear around the pivot:
    an iteration of S_f tokens takes pivot_time_s x S_f / pivot_tokens; with `pivot_time_s` None
    the policy learns it from the iterations it is told about (`Policy.observe`)."""

    pivot_tokens: int = 512             # S_pf: the forward size where throughput saturates
    pivot_time_s: float | None = None   # T_pf: an iteration's time at S_pf (None: learned)
    tile_tokens: int = 16               # the budget is a multiple of this
    max_budget_tokens: int = 4096       # the most tokens one iteration may compute
    window_s: float = 0.75              # gamma: SelectRequests' slack window
    long_prompt_tokens: int = 4096      # ERA: one prompt this long in prefill at a time
    default_ttft_s: float = 1.0         # targets of requests that name none
    default_tbt_s: float = 0.1875       # the paper's reading speed

    def __post_init__(self) -> None:
        for name in ("pivot_tokens", "tile_tokens", "max_budget_tokens", "long_prompt_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_budget_tokens < self.tile_tokens:
            raise ValueError(f"max_budget_tokens ({self.max_budget_tokens}) must be >= tile_tokens "
                             f"({self.tile_tokens})")
        for name in ("pivot_time_s", "window_s", "default_ttft_s", "default_tbt_s"):
            value = getattr(self, name)
            if value is None and name == "pivot_time_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


SCHEDULING_POLICIES = ("fcfs", "priority")  # EngineConfig.scheduling_policy: priority sets by_priority


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_model_len: int = 2048
    prompt_token_budget: int = 2048  # prompt / prefill-first / token policies: prefill tokens per iteration
    chunk_token_budget: int = 512    # mixed policy: all tokens per iteration (Sarathi-Serve)
    slo: SLOOptions = SLOOptions()   # the accelgen policies
    prompt_chunk_tokens: int = 8192  # prompt / token policies: a longer prompt is prefilled in chunks of this many
    by_priority: bool = False  # vLLM's priority scheduling (`Policy.rank`); False: first come, first served

    @property
    def longest_sequence(self) -> int:
        """Tokens one sequence may compute in one step: a prompt leaves room for one output token,
        and a sequence that reaches max_model_len finishes (so a recompute is no longer)."""
        return max(1, self.max_model_len - 1)
