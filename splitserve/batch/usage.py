"""A batch's `usage` (OpenAI's Batch object): the usage of its output file's lines, summed as they
are logged. Lines in the error file computed nothing a client is told of, and count none."""
from __future__ import annotations

from splitserve.api.usage import Usage


class BatchUsage:
    def __init__(self):
        self.total = Usage()

    def add(self, line: dict) -> None:
        """Count one output line (a 200 response whose body has the endpoint's usage); lines logged
        before usage had its details count none in them."""
        usage = line["response"]["body"]["usage"]
        prompt, completion = usage.get("prompt_tokens_details", {}), usage.get("completion_tokens_details", {})
        self.total += Usage(usage["prompt_tokens"], usage["completion_tokens"], prompt.get("cached_tokens", 0),
                            completion.get("reasoning_tokens", 0), prompt.get("cache_write_tokens", 0))

    def body(self) -> dict:
        return self.total.input_output_body()
