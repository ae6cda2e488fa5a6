"""One choice of an OpenAI response (whole, or as stream chunks) made from a run's token deltas."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from splitserve.api import response_bodies as R
from splitserve.api.logprob_bodies import Entry, chat_logprobs, completion_logprobs
from splitserve.api.tool_calls import StreamedCalls, ToolCall, parse_tool_calls
from splitserve.api.visible_text import TextStream
from splitserve.cluster.dispatch import RequestFailed, Run
from splitserve.cluster.metrics import RequestObservation


class RunResponse:
    """Turns a run's token deltas into an OpenAI choice or its stream chunks, timing the tokens as
    they leave (`on_done` gets the request's observation for the metrics). With logprobs asked
    for, each piece of text carries those of the tokens that made it (none past a stop string).

    `echo`: the prompt's text, put in front of the first piece (completions' `echo`), with the prompt
    tokens' logprobs in front of the first token's; `generated=False` (echo with max_tokens 0): the
    token the workers sampled is left out, so the response is the scored prompt alone.
    `tool_names`: the functions a chat offered; an output that is calls to them (`tool_calls`) is
    answered as calls."""

    def __init__(self, kind: str, run: Run, model: str, text: TextStream, started: float | None = None,
                 on_done: Callable[[RequestObservation], None] = lambda _: None, echo: str | None = None,
                 generated: bool = True, tool_names: frozenset[str] = frozenset(), index: int = 0,
                 response_id: str | None = None, num_top: int | None = None):
        """`index`, `response_id`: the choice's place and the response's id when several runs answer
        one request (`n`); `num_top`: the top alternatives per token the client asked logprobs of
        (None: none; the run may compute logprobs for best_of's ranking alone)."""
        self.kind, self.run, self.model, self.text = kind, run, model, text
        self._echo, self.generated, self.tool_names = echo, generated, tool_names
        self.index, self.response_id = index, response_id or run.request_id
        self.created = int(time.time())
        self.started = time.monotonic() if started is None else started
        self.on_done = on_done
        self.token_times: list[float] = []
        self.num_top = num_top
        self.cumulative_logprob = 0.0  # of the sampled tokens, when the run computes logprobs (best_of ranks by it)
        self._entries: list[Entry] = []  # of the text not yet handed out
        self._text_offset = 0  # completions' text_offset of the next token

    def observation(self, outcome: str) -> RequestObservation:
        times, end = self.token_times, time.monotonic()
        return RequestObservation(outcome, len(self.run.prompt), len(self.run.tokens),
                                  ttft=times[0] - self.started if times else None,
                                  tbt=tuple(b - a for a, b in zip(times, times[1:])),
                                  e2e=end - self.started, restarts=self.run.failures)

    async def pieces(self, every_delta: bool = False) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish reason) until done; a stop string seen here ends the run. Tokens
        whose text is held back yield nothing unless `every_delta` (then an empty piece)."""
        async for delta in self.run.deltas():
            self.token_times += [time.monotonic()] * len(delta.token_ids)
            if delta.logprobs is not None:
                self.cumulative_logprob += sum(lps[t] for t, lps in zip(delta.token_ids, delta.logprobs))
            echoed = self._take_echo()
            taken = self.text.append(delta.token_ids) if self.generated else 0
            if self.num_top is not None and delta.logprobs is not None:
                self._entries += zip(delta.token_ids[:taken], delta.logprobs[:taken])
            if self.text.stopped and delta.finish_reason is None:
                await self.run.abort()
            reason = "stop" if self.text.stopped else delta.finish_reason
            piece = echoed + self.text.delta(final=reason is not None)
            if piece or reason or (every_delta and delta.token_ids):
                yield piece, reason
            if reason:
                return

    @property
    def completion_tokens(self) -> int:
        return len(self.run.tokens) if self.generated else 0

    def _take_echo(self) -> str:
        """The echoed prompt, once (its logprobs join the entries; the first prompt token has none)."""
        if self._echo is None:
            return ""
        echoed, self._echo = self._echo, None
        if self.num_top is not None and self.run.prompt_logprobs is not None:
            self._entries += zip(self.run.prompt, (None, *self.run.prompt_logprobs[1:]))
        return echoed

    def take_logprobs(self) -> dict | None:
        """The logprobs object of the tokens since the last call, in this endpoint's shape."""
        if self.num_top is None:
            return None
        entries, self._entries = self._entries, []
        if self.kind == "chat":
            return chat_logprobs(entries, self.num_top, self.text.token_text)
        body = completion_logprobs(entries, self.num_top, self.text.token_text, self._text_offset)
        self._text_offset += sum(len(t) for t in body["tokens"])
        return body

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
        text, logprobs = "".join(parts), self.take_logprobs()
        if self.kind == "completion":
            return R.completion_choice(text, reason, logprobs, self.index)
        calls = parse_tool_calls(text, self.tool_names) if self.tool_names and reason == "stop" else None
        if calls:
            return R.chat_choice(None, "tool_calls", logprobs, [c.body() for c in calls], self.index)
        return R.chat_choice(text, reason, logprobs, index=self.index)

    async def chunks(self, continuous_usage: bool = False) -> AsyncIterator[dict]:
        """This run's stream chunks (a chat's first names the role); RequestFailed if it failed.
        Closed early (the client went away), it stops the run on the workers."""
        finished, outcome = False, "aborted"
        try:
            if self.kind == "chat":
                yield R.chat_chunk(self.response_id, self.model, self.created, role="assistant", content="",
                                   index=self.index)
            calls_filter = StreamedCalls(self.tool_names) if self.tool_names else None
            async for piece, reason in self.pieces(every_delta=continuous_usage):
                calls = None
                if calls_filter is not None:
                    held = calls_filter.feed(piece, reason)
                    if held is None:
                        continue
                    piece, calls, reason = held
                for chunk in self._call_chunks(calls) if calls else [self._chunk(piece, reason)]:
                    if continuous_usage:
                        chunk["usage"] = R.usage(len(self.run.prompt), self.completion_tokens)
                    yield chunk
            finished, outcome = True, "completed"
        except RequestFailed:
            finished, outcome = True, "failed"
            raise
        finally:
            if not finished:
                await self.run.abort()
            self.on_done(self.observation(outcome))

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

    def _chunk(self, piece: str, reason: str | None) -> dict:
        rid, logprobs = self.response_id, self.take_logprobs()
        if self.kind == "completion":
            return R.completion_chunk(rid, self.model, self.created, piece, reason, logprobs, self.index)
        return R.chat_chunk(rid, self.model, self.created, content=piece, finish_reason=reason, logprobs=logprobs,
                            index=self.index)
