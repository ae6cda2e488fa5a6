"""A batch's `usage` (OpenAI's Batch object): the usage of its output file's lines, summed as they
are logged. Lines in the error file computed nothing a client is told of, and count none."""
from __future__ import annotations

from splitserve.api.usage import Usage


class BatchUsage:
    def __init__(self):
        self.total = Usage()

    def add(self, line: dict) -> None:
        """Count one output line (a 200 response whose body has the endpoint's usage, in either
        shape); lines logged before usage had its details count none in them."""
        self.total += Usage.from_body(line["response"]["body"]["usage"])

    def body(self) -> dict:
        return self.total.input_output_body()
