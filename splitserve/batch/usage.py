"""A batch's `usage` (OpenAI's Batch object): the usage of its output file's lines, summed as they
are logged. Lines in the error file computed nothing a client is told of, and count none."""
from __future__ import annotations

from dataclasses import astuple

from splitserve.api.usage import Usage


class BatchUsage:
    def __init__(self):
        self.total = Usage()

    def add(self, line: dict) -> None:
        """Count one result line: a 200 response's body has the endpoint's usage, in either shape
        (lines logged before usage had its details count none in them); a failed request's, none."""
        usage = _usage(line)
        if usage is not None:
            self.total += usage

    def body(self) -> dict:
        return self.total.input_output_body()


def _usage(line: dict) -> Usage | None:
    """A result line's usage; None for a line without one, as the service writes a failed request
    (`response` null and an `error`, or an error body). A line it cannot have written is a ValueError."""
    response = line.get("response")
    if response is None:
        return None
    body = response.get("body") if isinstance(response, dict) else None
    if not isinstance(body, dict):
        raise _not_written(line, f"response is {repr(response)[:80]}, not an object with an object body")
    if body.get("usage") is None:
        return None
    try:
        usage = Usage.from_body(body["usage"])
    except (AttributeError, KeyError, TypeError):
        usage = None
    if usage is None or not all(type(count) is int and count >= 0 for count in astuple(usage)):
        raise _not_written(line, f"response.body.usage is {repr(body['usage'])[:80]}, not a usage object")
    return usage


def _not_written(line: dict, problem: str) -> ValueError:
    return ValueError(f"result line {line['custom_id']!r}: {problem}; the service writes no such line")
