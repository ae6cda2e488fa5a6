"""An OpenAI response, whole or streamed as SSE, from one run per choice (one, or several for `n`
and `best_of`; for each prompt of a completions request with several), each with its own index:
prompt k's choices are k x n to k x n + n - 1, as OpenAI numbers them. A whole response gathers
them (best_of keeps each prompt's n with the highest cumulative logprob), a stream interleaves
their chunks as they come. A choice failing is a 503 (the others are stopped), as a client going
away stops them all."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from fastapi.responses import Response

from splitserve.api import response_bodies as R
from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.choice_text import best_choices, choice_options
from splitserve.api.errors import error_response
from splitserve.api.request_models import GenerationRequest
from splitserve.api.request_sampling import choice_params
from splitserve.api.responses_events import ResponseEvents, sse_event
from splitserve.api.usage import Usage
from splitserve.api.visible_text import TextStream
from splitserve.cluster.dispatch import RequestFailed, Run
from splitserve.cluster.large_bodies import encoded, json_response
from splitserve.cluster.metrics import RequestObservation
from splitserve.cluster.run_response import RunResponse

_DONE = object()


class ChoicesResponse:
    def __init__(self, groups: list[list[RunResponse]], num_returned: int, first_prompt: int = 0):
        """`groups`: per prompt, from the request's prompt `first_prompt` on, the runs of its
        choices, of which `num_returned` return."""
        self.groups, self.num_returned, self.first_prompt = groups, num_returned, first_prompt
        self.replies = [reply for group in groups for reply in group]
        first = self.replies[0]
        self.kind, self.response_id, self.model, self.created = first.kind, first.response_id, first.model, first.created

    @property
    def usage(self) -> Usage:
        """Each prompt (and its cache hit) once, from its first choice; every choice's output,
        reasoning tokens, cache writes and prediction drafts, returned or not (best_of's are computed too)."""
        firsts, every = sum((g[0].usage for g in self.groups), Usage()), sum((r.usage for r in self.replies), Usage())
        return replace(every, prompt_tokens=firsts.prompt_tokens, cached_tokens=firsts.cached_tokens)

    async def body(self) -> dict:
        """The whole response body; RequestFailed if a choice failed (the others are stopped). A
        cancelled caller stops them all."""
        return R.response_body(self.kind, self.response_id, self.model, self.created, await self.choices(),
                               self.usage)

    async def choices(self) -> list[dict]:
        """The returned choices, numbered as OpenAI numbers them; raises as `body` does."""
        tasks = [asyncio.ensure_future(reply.collect()) for reply in self.replies]
        try:
            choices = await asyncio.gather(*tasks)
        except (RequestFailed, asyncio.CancelledError):  # a cancelled collect stops its run
            await self._stop(tasks)
            raise
        returned, at = [], 0
        for k, group in enumerate(self.groups, self.first_prompt):
            mine, at = choices[at:at + len(group)], at + len(group)
            returned += best_choices(mine, [r.cumulative_logprob for r in group], self.num_returned,
                                     k * self.num_returned)
        return returned

    async def abort(self) -> None:
        """Stop every run: a response nobody will read (a background one the store could not keep)."""
        for reply in self.replies:
            await reply.run.abort()

    async def whole(self) -> Response:
        try:
            body = await self.body()
        except RequestFailed as error:
            return error_response(error.as_error())
        return await encoded(body, json_response)

    async def sse(self, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
        """SSE chunks; `continuous_usage` (vLLM's extension) puts the running usage in every chunk
        and sends one per token delta, so a benchmark can time every token."""
        try:
            async with aclosing(self._chunks(continuous_usage)) as chunks:
                async for chunk in chunks:
                    yield await encoded(chunk, R.sse_event)
            if include_usage:
                yield R.sse_event(R.usage_chunk(self.kind, self.response_id, self.model, self.created, self.usage))
            yield R.SSE_DONE
        except RequestFailed as error:
            yield R.sse_error(error.as_error())

    async def response_events(self, events: ResponseEvents) -> AsyncIterator[bytes]:
        """This one choice as a `/v1/responses` stream (`responses_events`)."""
        for event in events.start():
            yield sse_event(event)
        try:
            async with aclosing(self.replies[0].chunks()) as chunks:
                async for chunk in chunks:
                    for event in events.chunk(chunk):
                        yield await encoded(event, sse_event)
            for event in events.finish(self.usage):  # each of the last four holds every logprob of the text
                yield await encoded(event, sse_event)
        except RequestFailed as error:
            for event in events.fail(str(error)):
                yield sse_event(event)

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


def choices_for(kind: str, request: GenerationRequest, leaders: list[Run], tokenizer, started: float | None = None,
                on_done: Callable[[RequestObservation], None] = lambda _: None,
                follower_retry_s: float | None = None, first_prompt: int = 0,
                parsers: ChatParsers = ChatParsers()) -> ChoicesResponse:
    """The response to `request`, whose prompts' first choices are `leaders` (admitted; the
    request's prompts from `first_prompt` on): with n or best_of above 1, one more run per further
    choice of each prompt, each with its own seed stream, admitted on its leader's workers once the
    leader's prefill is cached there (`follower_retry_s`: how often one the cluster cannot take yet
    is tried again; None: it fails the response). `parsers`: how chat outputs are read."""
    runs, returned = request.num_choices()
    response_id = leaders[0].request_id

    def group(k: int, leader: Run) -> list[RunResponse]:
        options = choice_options(request, k, leader.prompt, tokenizer, parsers)
        choices = [leader]
        for index in range(1, runs):
            follower = Run(f"{leader.request_id}-{index}", leader.prompt, choice_params(leader.params, index),
                           leader.workers, leader.max_attempts, prefix=leader.prefix)
            follower.admit_after(leader, follower_retry_s)
            choices.append(follower)
        return [RunResponse(kind, run, request.model, TextStream(tokenizer, run.params, run.prompt), started, on_done,
                            index=k * returned + i, response_id=response_id, **options)
                for i, run in enumerate(choices)]

    return ChoicesResponse([group(k, leader) for k, leader in enumerate(leaders, first_prompt)], returned, first_prompt)
