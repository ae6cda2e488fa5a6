"""A request the engine holds: its sequence and what its outputs have gathered so far (tokens,
their times and logprobs, its text), from which each step's `RequestOutput` is built."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.outputs import CompletionOutput, RequestOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.tokenizer import Detokenizer


@dataclass
class TrackedRequest:
    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer | None  # None: params.detokenize is off
    output_ids: list[int] = field(default_factory=list)  # seq.output_token_ids, grown as steps append
    timestamps: list[float] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by prompt position; [0] stays None
    embedding: list[float] | None = None  # with params.embed, once its prefill ran: RequestOutput.embedding

    @property
    def stops_on_text(self) -> bool:
        """Its outputs' text can end it (stop strings): recording a token may finish it."""
        return self.detokenizer is not None and bool(self.seq.params.stop)

    def append(self, tokens: list[tuple[int, dict[int, float] | None]], now: float) -> bool:
        """Add the tokens a step appended to the sequence (with their logprobs); whether a stop string
        ended it, on the token that completed it (the rest are dropped). The policy ended the
        sequence on the last token if its id did (EOS, a stop id): a stop string wins over a length
        limit the same token hit."""
        for i, (token_id, logprobs) in enumerate(tokens):
            self.output_ids.append(token_id)
            self.timestamps.append(now)
            if self.logprobs is not None:
                self.logprobs.append(logprobs or {})
            stop_token = i == len(tokens) - 1 and self.seq.finish_reason == "stop"
            if self.detokenizer is not None and self.detokenizer.append(token_id, stop_token):
                return True
        return False

    def output(self) -> RequestOutput:
        seq = self.seq
        text = "" if self.detokenizer is None else self.detokenizer.text
        completion = CompletionOutput(0, text, self.output_ids, seq.finish_reason, self.logprobs, self.timestamps)
        return RequestOutput(seq.seq_id, self.prompt, seq.prompt_token_ids, [completion], seq.is_finished,
                             seq.arrival_time, seq.num_cached_tokens, seq.num_cache_write_tokens,
                             seq.first_scheduled_time, self.prompt_logprobs, self.embedding,
                             seq.accepted_prediction_tokens, seq.rejected_prediction_tokens)
