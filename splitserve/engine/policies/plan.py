"""What a policy hands the model runner for one iteration."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute `seq.token_ids[start : start + num_new_tokens]`; sample a token iff that reaches the end."""

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", self.seq.num_computed_tokens)
        object.__setattr__(self, "samples", self.start + self.num_new_tokens == self.seq.num_tokens)


@dataclass(frozen=True)
class Plan:
    scheduled: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for item in self.scheduled if item.seq.is_decoding)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_model_len: int = 2048
    prompt_token_budget: int = 2048  # prompt / prefill-first / token policies: prefill tokens per iteration
    chunk_token_budget: int = 512    # mixed policy: all tokens per iteration (Sarathi-Serve)
