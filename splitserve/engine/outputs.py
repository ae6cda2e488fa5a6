"""What the engine returns per request (vLLM's `RequestOutput` / `CompletionOutput` shape), and
what one step did (`StepStats`, for metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled token included
    token_timestamps: list[float] = field(default_factory=list)  # time.monotonic() when each token was sampled


@dataclass
class RequestOutput:
    """Cumulative state of one request after a step: all tokens and text so far. Its lists (token
    ids, logprobs, timestamps) are the request's own, which later steps extend (a step costs the
    same at the thousandth token as at the first): copy them to keep what one step returned."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0  # prompt tokens its prefill added to the prefix cache
    first_scheduled_time: float | None = None  # time.monotonic() of its first step (None: imported KV)
    # per prompt position: {token id: logprob}, the prompt's token included; None at position 0.
    # None when not asked for, and on a token worker (the prompt worker computed them)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with SamplingParams.embed, once its prefill ran (else None): the embedding, or with label_token_ids
    # the logits at those ids
    embedding: list[float] | None = None
    # with SamplingParams.prediction, where the engine speculates: its drafts kept, and thrown away
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def token_timestamps(self) -> list[float]:
        return self.outputs[0].token_timestamps


@dataclass(frozen=True)
class StepStats:
    """One iteration: tokens computed (prefill and decode) and its wall time."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    decode_context_tokens: int = 0  # KV tokens the decodes' attention read (the memory-bound work)
    prefill_attention_pairs: int = 0  # query-key pairs of prefill attention: sum n (2 start + n) over chunks
    chunk_context_tokens: int = 0  # sum over prefill chunks of n x start (tokens computed before the chunk)
    draft_tokens: int = 0     # speculated tokens its decodes checked (counted in decode_tokens too)
    accepted_tokens: int = 0  # of them, those kept (`speculation`)

    @property
    def phase(self) -> str:
        if not self.decode_tokens:
            return "prefill"
        return "decode" if not self.prefill_tokens else "mixed"
