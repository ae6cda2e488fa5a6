"""A batch's `usage` (OpenAI's Batch object): the usage of its output file's lines, summed as they
are logged. Lines in the error file computed nothing a client is told of, and count none."""
from __future__ import annotations


class BatchUsage:
    def __init__(self):
        self.input_tokens = self.cached_tokens = self.output_tokens = self.reasoning_tokens = 0

    def add(self, line: dict) -> None:
        """Count one output line (a 200 response whose body has the endpoint's usage); lines logged
        before usage had its details count none in them."""
        usage = line["response"]["body"]["usage"]
        self.input_tokens += usage["prompt_tokens"]
        self.output_tokens += usage["completion_tokens"]
        self.cached_tokens += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        self.reasoning_tokens += usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)

    def body(self) -> dict:
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}
