"""An OpenAI response, whole or streamed as SSE, from one run per choice (one, or several for `n`
and `best_of`), each with its own index: a whole response gathers them (best_of keeps the n with
the highest cumulative logprob), a stream interleaves their chunks as they come. A choice failing
is a 503 (the others are stopped), as a client going away stops them all."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse

from splitserve.api import response_bodies as R
from splitserve.api.errors import RequestError, error_response
from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.run_response import RunResponse

_DONE = object()


class ChoicesResponse:
    def __init__(self, replies: list[RunResponse], num_returned: int):
        self.replies, self.num_returned = replies, num_returned
        first = replies[0]
        self.kind, self.response_id, self.model, self.created = first.kind, first.response_id, first.model, first.created

    @property
    def usage(self) -> tuple[int, int]:
        """The prompt once; every choice's tokens, returned or not (best_of's are computed too)."""
        return len(self.replies[0].run.prompt), sum(r.completion_tokens for r in self.replies)

    async def whole(self) -> JSONResponse:
        tasks = [asyncio.ensure_future(reply.collect()) for reply in self.replies]
        try:
            choices = await asyncio.gather(*tasks)
        except RequestFailed as error:
            await self._stop(tasks)
            return error_response(RequestError(str(error), status=503, type="service_unavailable"))
        except asyncio.CancelledError:  # the client went away: each collect stops its run
            await self._stop(tasks)
            raise
        if self.num_returned < len(choices):
            ranked = sorted(zip(self.replies, choices), key=lambda rc: -rc[0].cumulative_logprob)
            choices = [{**choice, "index": i} for i, (_, choice) in enumerate(ranked[:self.num_returned])]
        return JSONResponse(R.response_body(self.kind, self.response_id, self.model, self.created, choices,
                                            *self.usage))

    async def sse(self, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
        """SSE chunks; `continuous_usage` (vLLM's extension) puts the running usage in every chunk
        and sends one per token delta, so a benchmark can time every token."""
        try:
            async with aclosing(self._chunks(continuous_usage)) as chunks:
                async for chunk in chunks:
                    yield R.sse_event(chunk)
            if include_usage:
                yield R.sse_event(R.usage_chunk(self.kind, self.response_id, self.model, self.created, *self.usage))
            yield R.SSE_DONE
        except RequestFailed as error:
            yield R.sse_error(RequestError(str(error), status=503, type="service_unavailable"))

    def _chunks(self, continuous_usage: bool) -> AsyncIterator[dict]:
        """Every choice's chunks; one choice streams straight through, several are interleaved."""
        if len(self.replies) == 1:
            return self.replies[0].chunks(continuous_usage)
        return self._interleaved(continuous_usage)

    async def _interleaved(self, continuous_usage: bool) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(reply: RunResponse):
            try:
                async for chunk in reply.chunks(continuous_usage):
                    await queue.put(chunk)
                await queue.put(_DONE)
            except RequestFailed as error:
                await queue.put(error)

        tasks = [asyncio.ensure_future(pump(reply)) for reply in self.replies]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, RequestFailed):
                    raise item
                else:
                    yield item
        finally:
            await self._stop(tasks)

    @staticmethod
    async def _stop(tasks: list[asyncio.Future]) -> None:
        """Cancel what still runs and wait for it to stop its run on the workers."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
