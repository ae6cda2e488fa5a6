"""A streamed `/v1/responses` answer: the chat stream chunks of its choice in, OpenAI's Responses
stream events out, each numbered (`sequence_number`) and named on its SSE `event:` line.

Order, as OpenAI's: `response.created` and `response.in_progress`; then per output item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`, `response.output_text.delta`
after `response.content_part.added`, `response.function_call_arguments.delta`) and their `.done`
events, `response.output_item.done`; last `response.completed` (`response.incomplete` when the
length limit cut it) with the whole response and its usage. A choice that fails is an `error`
event, then `response.failed`. Invariant: at most one item is open, and an item is done before
the next one is added."""
from __future__ import annotations

from splitserve.api import response_bodies as R
from splitserve.api.responses_bodies import (
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_object,
    status_of,
)
from splitserve.api.responses_request import ResponsesRequest
from splitserve.api.usage import Usage


class ResponseEvents:
    def __init__(self, request: ResponsesRequest, response_id: str, created: int, stored: bool = False):
        self.request, self.response_id, self.created, self.stored = request, response_id, created, stored
        self.whole: dict | None = None  # the whole response, once the last events are made
        self.output: list[dict] = []  # the items done, in order
        self._open: dict | None = None  # the item being streamed (its `type`, `id`, `call_id`, `name`)
        self._text = ""  # the open item's text, or its call's arguments, so far
        self._logprobs: list[dict] = []  # the open message's, so far
        self._held: list[dict] = []  # logprobs of tokens whose text is not out yet (held for a stop string)
        self._sequence = 0
        self._finish_reason: str | None = None

    def start(self) -> list[dict]:
        snapshot = response_object(self.request, self.response_id, self.created, "in_progress", [],
                                   stored=self.stored)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat stream chunk (of the one choice)."""
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            self._held += (choice.get("logprobs") or {}).get("content") or ()
            if delta.get("reasoning"):
                events += self._append("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._append("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                if "id" in call:  # a call's first piece names it; its arguments follow
                    events += self._close("completed")
                    events += self._add({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                                         "name": call["function"]["name"]})
                events += self._append("function_call", call["function"].get("arguments", ""))
            self._finish_reason = choice["finish_reason"] or self._finish_reason
        return events

    def finish(self, usage: Usage) -> list[dict]:
        """The last events: the open item done, then the whole response."""
        status = status_of(self._finish_reason)
        events = self._close(status)
        self.whole = response_object(self.request, self.response_id, self.created, status, self.output, usage,
                                     stored=self.stored)
        return events + [self._event(f"response.{status}", response=self.whole)]

    def fail(self, message: str) -> list[dict]:
        """A failed choice: an error event, then the response failed (the items done so far in it)."""
        error = {"code": "server_error", "message": message}
        self.whole = response_object(self.request, self.response_id, self.created, "failed", self.output,
                                     error=error, stored=self.stored)
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self.whole)]

    # ---- items ------------------------------------------------------------------------------
    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._add({"type": kind, "id": new_id("rs" if kind == "reasoning"
                                                                                       else "msg")})
        if not text:
            return events
        self._text += text
        place = self._place()
        if kind == "function_call":
            return events + [self._event("response.function_call_arguments.delta", delta=text, **place)]
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", content_index=0, delta=text, **place)]
        logprobs, self._held = self._held, []
        self._logprobs += logprobs
        return events + [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs,
                                     **place)]

    def _add(self, item: dict) -> list[dict]:
        self._open, self._text, self._logprobs = item, "", []
        added = [self._event("response.output_item.added", output_index=len(self.output),
                             item=self._item("in_progress"))]
        if item["type"] == "message":
            added.append(self._event("response.content_part.added", content_index=0, part=output_text(""),
                                     **self._place()))
        return added

    def _close(self, status: str) -> list[dict]:
        """The open item's done events (`status`: a message's, "incomplete" when cut short)."""
        if self._open is None:
            return []
        kind, place, text = self._open["type"], self._place(), self._text
        if kind == "function_call":
            events = [self._event("response.function_call_arguments.done", arguments=text, name=self._open["name"],
                                  **place)]
        elif kind == "reasoning":
            events = [self._event("response.reasoning_text.done", content_index=0, text=text, **place)]
        else:
            self._logprobs, self._held = self._logprobs + self._held, []
            events = [self._event("response.output_text.done", content_index=0, text=text, logprobs=self._logprobs,
                                  **place),
                      self._event("response.content_part.done", content_index=0, part=output_text(text, self._logprobs),
                                  **place)]
        item = self._item(status if kind == "message" else "completed")
        events.append(self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self._open = None
        return events

    def _item(self, status: str) -> dict:
        item, text = self._open, self._text
        if item["type"] == "function_call":
            return function_call_item(item["id"], item["call_id"], item["name"], text, status)
        if item["type"] == "reasoning":
            return reasoning_item(item["id"], text, status)
        return message_item(item["id"], text if status != "in_progress" else None, status, self._logprobs)

    def _place(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def sse_event(event: dict, in_pieces: bool = False) -> bytes:
    """One event as OpenAI frames it: its type on the `event:` line, then its JSON (`in_pieces`:
    as `response_bodies.sse_event`)."""
    return f"event: {event['type']}\n".encode() + R.sse_event(event, in_pieces)
