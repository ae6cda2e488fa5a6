"""A request's token state as the schedulers see it. Pure Python: the simulator drives it too."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.bad_words import BadWords


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV blocks
    RUNNING = "running"      # holds KV blocks; scheduled every iteration it fits
    IMPORTING = "importing"  # holds KV blocks reserved for an incoming transfer; not schedulable
    PREFILLED = "prefilled"  # prompt-only role: first token sampled, KV kept for export
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # an entity: equal only to itself; slots: the schedulers' hot path
class Sequence:
    """One request. `token_ids` is prompt + generated tokens.

    Invariant: the KV of `token_ids[:num_computed_tokens]` is in the sequence's blocks. A step
    computes `token_ids[num_computed_tokens : num_computed_tokens + n]`; when that reaches the
    end of `token_ids`, the step samples one new token. A decode is simply a step with n == 1, so
    prefill, chunked prefill, decode and recompute after preemption are one mechanism.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the first allocation (what usage reports cached)
    num_cache_write_tokens: int = 0  # prompt tokens its first prefill added to the prefix cache (whole blocks)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    num_skips: int = 0  # iterations in a row this decode was left out of a full batch (orca)
    first_scheduled_time: float | None = None  # when its first step ran (arrival to this: queue time)
    hand_off: bool = False  # prefill here, decode elsewhere: after its first token it is held with its KV for export
    # handed off: per KV layer group, the first position its export sends (the token worker's reach);
    # a windowed group releases the blocks before it as the prefill passes them. (): it keeps all
    export_from: tuple[int, ...] = ()
    adapter_identity: str | None = None  # the LoRA adapter it runs under (its identity: lora_adapter); None: none
    adapter_slot: int = -1  # the device slot holding it while it computes (lora_residency); -1: none
    awaits_adapter_slot: bool = False  # preempted as its import landed with no slot for its adapter, until one is
    bad_words: BadWords | None = None  # params.bad_words in the engine's token ids (None: none)
    accepted_prediction_tokens: int = 0  # drafts from params.prediction that steps kept (engine.speculation)
    rejected_prediction_tokens: int = 0  # ... and those they threw away

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def generated_token_ids(self) -> list[int]:
        """The request's whole output: what earlier attempts made (the prompt's resumed tail) and this one."""
        return self.token_ids[len(self.prompt_token_ids) - self.params.resumed_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True once only the last sampled token lacks KV (the prompt, or recompute, is done)."""
        num_tokens = len(self.token_ids)
        return num_tokens - self.num_computed_tokens == 1 and num_tokens > len(self.prompt_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and are not computed yet: every prompt position must run
        through the model (no prefix-cache hit may skip one)."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def stop_reason_after_append(self, max_model_len: int) -> str | None:
        """Why the sequence stops after its newest token, by token ids and lengths alone."""
        params, token_ids = self.params, self.token_ids
        num_tokens = len(token_ids)
        num_output = num_tokens - len(self.prompt_token_ids)
        if num_output >= params.min_tokens:
            last = token_ids[-1]
            if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
                return "stop"
        if num_output >= params.max_tokens or num_tokens >= max_model_len:
            return "length"
        return None
