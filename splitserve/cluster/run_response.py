"""One choice of an OpenAI response (whole, or as stream chunks) made from a run's token deltas."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping

from splitserve.api import response_bodies as R
from splitserve.api.choice_text import ChoiceText
from splitserve.api.harmony import HarmonySplitter
from splitserve.api.reasoning import ReasoningSplitter, reasoning_splitter
from splitserve.api.tool_calls import LLAMA3_JSON, StreamedCalls, ToolCall
from splitserve.api.usage import Usage
from splitserve.api.visible_text import TextStream
from splitserve.cluster.bucket_counts import BucketCounts
from splitserve.cluster.dispatch import RequestFailed, Run
from splitserve.cluster.large_bodies import built
from splitserve.cluster.metrics import LATENCY_BUCKETS, RequestObservation


class RunResponse:
    """Turns a run's token deltas into an OpenAI choice or its stream chunks (`ChoiceText`: with
    logprobs asked for, each piece of text carries those of the tokens that made it, none past a
    stop string), timing the tokens as they leave (`on_done` gets the request's observation for
    the metrics). A stop string seen here stops the run on the workers."""

    def __init__(self, kind: str, run: Run, model: str, text: TextStream, started: float | None = None,
                 on_done: Callable[[RequestObservation], None] = lambda _: None, echo: str | None = None,
                 generated: bool = True, tool_names: Mapping[str, Mapping[str, str]] | None = None, index: int = 0,
                 response_id: str | None = None, num_top: int | None = None, tool_parser: str = LLAMA3_JSON,
                 thinking: bool | str | None = None, call_ids: str = LLAMA3_JSON, ids_as_tokens: bool = False):
        """`echo`, `generated`, `tool_names`, `num_top`, `tool_parser`, `thinking`, `call_ids`,
        `ids_as_tokens`: as ChoiceText's;
        `index`, `response_id`: the choice's place and the response's id when several runs answer
        one request (`n`)."""
        self.kind, self.run, self.model = kind, run, model
        self.choice = ChoiceText(kind, text, run.prompt, echo, generated, tool_names, index, num_top, tool_parser,
                                 thinking, call_ids, ids_as_tokens)
        self.index, self.response_id = index, response_id or run.request_id
        self.created = int(time.time())
        self.started = time.monotonic() if started is None else started
        self.on_done = on_done
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps = BucketCounts.over(LATENCY_BUCKETS)  # between tokens as they leave (a delta's own: 0)

    @property
    def cumulative_logprob(self) -> float:
        return self.choice.cumulative_logprob

    def observation(self, outcome: str) -> RequestObservation:
        first = self.first_token_at
        return RequestObservation(outcome, len(self.run.prompt), len(self.run.tokens), self.run.cached_tokens or 0,
                                  ttft=None if first is None else first - self.started,
                                  tbt=None if first is None else self.gaps,
                                  e2e=time.monotonic() - self.started, restarts=self.run.failures,
                                  refused_placements=self.run.refusals, lora=self.run.params.lora)

    def _time(self, tokens: int) -> None:
        """`tokens` tokens left now, in one delta."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.add(now - self.last_token_at)
        self.gaps.add(0.0, tokens - 1)
        self.last_token_at = now

    async def pieces(self, every_delta: bool = False) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish reason) until done; a stop string seen here ends the run. Tokens
        whose text is held back yield nothing unless `every_delta` (then an empty piece)."""
        async for delta in self.run.deltas():
            if delta.token_ids:
                self._time(len(delta.token_ids))
            piece, reason = self.choice.add(delta.token_ids, delta.logprobs, delta.finish_reason,
                                            self.run.prompt_logprobs)
            if self.choice.text.stopped and delta.finish_reason is None:
                await self.run.abort()
            if piece or reason or (every_delta and delta.token_ids):
                yield piece, reason
            if reason:
                return

    @property
    def completion_tokens(self) -> int:
        return len(self.run.tokens) if self.choice.generated else 0

    @property
    def usage(self) -> Usage:
        """This choice's prompt, output, cached prompt and reasoning tokens (no cache hit or write
        known before its first token), and its prediction's drafts kept and thrown away (known at its end)."""
        return Usage(len(self.run.prompt), self.completion_tokens, self.run.cached_tokens or 0,
                     self.choice.reasoning_tokens, self.run.cache_write_tokens or 0, *self.run.prediction_tokens)

    def take_logprobs(self) -> dict | None:
        return self.choice.take_logprobs()

    async def collect(self) -> dict:
        """This run's whole choice; RequestFailed if it failed. A cancelled caller (the client went
        away) stops it on the workers."""
        parts, reason, finished = [], None, False
        try:
            async for piece, reason in self.pieces():
                parts.append(piece)
            finished = True
        except RequestFailed:
            finished = True
            self.on_done(self.observation("failed"))
            raise
        finally:
            if not finished:
                await self.run.abort()
                self.on_done(self.observation("aborted"))
        self.on_done(self.observation("completed"))
        return await self._built(self.choice.choice, "".join(parts), reason)

    async def chunks(self, continuous_usage: bool = False) -> AsyncIterator[dict]:
        """This run's stream chunks (a chat's first names the role); RequestFailed if it failed.
        Closed early (the client went away), it stops the run on the workers."""
        finished, outcome = False, "aborted"
        try:
            if self.kind == "chat":
                yield R.chat_chunk(self.response_id, self.model, self.created, role="assistant", content="",
                                   index=self.index)
            thinking = None if self.choice.thinking is None else reasoning_splitter(self.choice.thinking)
            calls_filter = StreamedCalls(self.choice.tool_names, self.choice.tool_parser, self.choice.call_ids) \
                if self.choice.tool_names else None
            async for piece, reason in self.pieces(every_delta=continuous_usage):
                for chunk in await self._built(self._piece_chunks, piece, reason, thinking, calls_filter,
                                               continuous_usage):
                    yield chunk
            finished, outcome = True, "completed"
        except RequestFailed:
            finished, outcome = True, "failed"
            raise
        finally:
            if not finished:
                await self.run.abort()
            self.on_done(self.observation(outcome))

    async def _built(self, build: Callable, *args):
        """`build(*args)`, in a thread when the choice's pending logprobs are many (nothing else
        touches this choice meanwhile: its stream or collect awaits it)."""
        return await built(self.choice.pending_logprobs, build, *args)

    def _piece_chunks(self, piece: str, reason: str | None, thinking: ReasoningSplitter | HarmonySplitter | None,
                      calls_filter: StreamedCalls | None, continuous_usage: bool) -> list[dict]:
        """The chunks of one piece: its reasoning split off (`thinking`), tool calls held until whole
        (`calls_filter`), the running usage in each with `continuous_usage`."""
        chunks = []
        if thinking is not None:
            thought, piece = thinking.feed(piece, final=reason is not None)
            if thought:
                chunks.append(self._chunk("", None, reasoning=thought))
        calls, holding = None, False
        if calls_filter is not None:
            sent = calls_filter.feed(piece, reason)
            holding = sent is None
            piece, calls, reason = ("", None, None) if holding else sent
        if calls:
            chunks += ([self._chunk(piece, None)] if piece else []) + self._call_chunks(calls)
        elif piece or reason or (continuous_usage and not chunks and not holding):
            chunks.append(self._chunk(piece, reason))
        if continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self.usage.body()
        return chunks

    def _call_chunks(self, calls: list[ToolCall]) -> list[dict]:
        """OpenAI's streamed calls: per call its id and name first, then its arguments; then the
        finish reason."""
        rid, parts = self.response_id, []
        for i, call in enumerate(calls):
            parts += [{"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
                      {"index": i, "function": {"arguments": call.arguments}}]
        chunks = [R.chat_chunk(rid, self.model, self.created, tool_calls=[part], index=self.index) for part in parts]
        return chunks + [R.chat_chunk(rid, self.model, self.created, finish_reason="tool_calls",
                                      logprobs=self.take_logprobs(), index=self.index)]

    def _chunk(self, piece: str, reason: str | None, reasoning: str | None = None) -> dict:
        """A chunk of content, or of `reasoning` (then its delta has no content)."""
        rid, logprobs = self.response_id, self.take_logprobs()
        if self.kind == "completion":
            return R.completion_chunk(rid, self.model, self.created, piece, reason, logprobs, self.index)
        return R.chat_chunk(rid, self.model, self.created, content=None if reasoning else piece, finish_reason=reason,
                            logprobs=logprobs, index=self.index, reasoning=reasoning)
