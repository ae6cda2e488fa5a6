"""A stand-in for a Ray actor's method, for tests of the cluster code without Ray."""
from __future__ import annotations


class RemoteMethod:
    """Answers `result` (raises it, if it is an exception) when awaited; records each call's args."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def remote(self, *args):
        self.calls.append(args)

        async def answer():
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result
        return answer()
