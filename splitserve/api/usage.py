"""A response's token counts and OpenAI's `usage` bodies for them (the chat and completions shape,
and the input/output shape of the Responses and Batch objects)."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Usage:
    """Every prompt counted once; every computed choice's output (best_of's unreturned ones too);
    `cached_tokens`: the prompt tokens whose KV the prefix cache held (counted once per prompt, from
    its first choice: later choices of one prompt reuse its prefill by design); `reasoning_tokens`:
    of the completion tokens, those a reasoning parser read as thinking (`ChoiceText`);
    `cache_write_tokens`: the prompt tokens whose KV the prefills added to the prefix cache;
    `accepted_prediction_tokens` / `rejected_prediction_tokens`: drafts from a chat's `prediction`
    that decodes kept / threw away (OpenAI's Predicted Outputs; both 0 where the server does not
    speculate)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cache_write_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Usage)))

    @classmethod
    def from_body(cls, body: dict) -> Usage:
        """The counts of a usage body of either shape, or an embeddings response's; details a body
        lacks count 0."""
        if "input_tokens" in body:
            inputs, outputs = body.get("input_tokens_details", {}), body.get("output_tokens_details", {})
            prompt, completion = body["input_tokens"], body["output_tokens"]
        else:
            inputs, outputs = body.get("prompt_tokens_details", {}), body.get("completion_tokens_details", {})
            prompt = body["prompt_tokens"]  # an embeddings body has no completion tokens: its total is its prompt
            completion = body["completion_tokens"] if "completion_tokens" in body else body["total_tokens"] - prompt
        return cls(prompt, completion, inputs.get("cached_tokens", 0), outputs.get("reasoning_tokens", 0),
                   inputs.get("cache_write_tokens", 0), outputs.get("accepted_prediction_tokens", 0),
                   outputs.get("rejected_prediction_tokens", 0))

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": self._input_details(),
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens,
                                              "accepted_prediction_tokens": self.accepted_prediction_tokens,
                                              "rejected_prediction_tokens": self.rejected_prediction_tokens}}

    def input_output_body(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": self._input_details(),
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _input_details(self) -> dict:
        return {"cached_tokens": self.cached_tokens, "cache_write_tokens": self.cache_write_tokens}
