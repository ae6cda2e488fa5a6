"""Stored responses in a cluster: the store (`api/response_store.py`) is one actor the controller
deployment owns, which every ingress replica reaches through `StoredResponses`; the routes that
read, cancel and delete them: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
POST /v1/responses/{id}/cancel; and GET /v1/responses/{id}?stream=true&starting_after=N, which
streams a background response's events again, from any replica.

A response is kept when it ends (`store` not false and the store not sized 0): a whole one once
answered, a streamed one before its last events are sent (a failed one too: its id was sent). A
response a client never got (a 4xx, a whole response that failed) is not. A background one is
kept in progress when admitted, and settled by a task of the replica that admitted it, which is
cancelled (stopping its runs) once the store says the response was cancelled, on any replica, or
deleted. Asking renews its lease: were that replica to die, another adopts the response once the
lease lapses and runs it again from its request (`run_again`; not a streamed one, which ends
failed: `api/response_store.py`). A background one that streams sends its client the events
as that task makes them, and the task records them in the store; the client may go away and read
them again. The store is the controller's actor: after a restart the next call finds the new one
(`OwnedActor`), which has every response kept on disk (not the events: a running stream's task
records them again). The store keeps each response as its JSON text: a replica encodes what it
keeps and decodes what it reads (`large_bodies`), and answers a retrieve with the stored text as it is.

A response in a conversation (`conversation`) reads its items first, and once it completed (or was
cut short) adds its own input and output to it (`end`, `ending`; a background one once settled,
not when cancelled): before its answer, or its stream's last events, is sent."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import RayTaskError

from splitserve.api.cursor_page import cursor_page, in_order
from splitserve.api.errors import RequestError, error_response
from splitserve.api.json_pieces import json_text
from splitserve.api.response_store import MAX_ITEMS_PAGE, Stored
from splitserve.api.responses_events import ResponseEvents
from splitserve.api.responses_request import ResponsesRequest
from splitserve.cluster.background import background
from splitserve.cluster.dispatch import RequestFailed
from splitserve.cluster.large_bodies import decoded, encoded, json_response, text_response
from splitserve.cluster.owned_actor import OwnedActor

router = APIRouter()
log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.5
EVENT_FLUSH_S = 0.1  # a background stream's events reach the store at least this often
RESUME_POLL_S = 0.1  # a background stream read again asks the store for new events this often
ADOPT_POLL_S = 1.0  # each replica asks the store this often for background responses whose replica died
ADOPT_MOST = 4  # ... and takes at most this many at a time
RunAgain = Callable[[dict, dict], Awaitable[dict]]


class StoredResponses:
    def __init__(self, store: OwnedActor, enabled: bool, run_again: RunAgain | None = None):
        """`run_again(pending, rerun)`: a background response whose replica died, run here from
        the start (its whole response, or a RequestFailed); without, this replica adopts none."""
        self._store, self.enabled, self._run_again = store, enabled, run_again
        self._running: dict[str, asyncio.Task] = {}  # background responses this replica settles, by id
        self._poller: asyncio.Task | None = None
        self._adopter: asyncio.Task | None = None

    def keeps(self, request: ResponsesRequest) -> bool:
        return self.enabled and request.store is not False

    async def context(self, request: ResponsesRequest) -> list[dict]:
        """The conversation `previous_response_id` continues ([] when it names none); a 400 for a
        background request this server cannot keep."""
        if request.background and not self.keeps(request):
            raise RequestError("background: a background response is kept and polled (GET /v1/responses/{id}); "
                               "it needs store", param="background")
        if request.conversation is not None:
            return await self._conversation(request)
        response_id = request.previous_response_id
        if response_id is None:
            return []
        if not self.enabled:
            raise RequestError("previous_response_id: this server keeps no responses (ingress.stored_responses "
                               "is 0); send the conversation in input", param="previous_response_id")
        context = await self.call("context", response_id)
        if context is None:
            raise _missing(response_id, "previous_response_id")
        return continued(*context)

    async def _conversation(self, request: ResponsesRequest) -> list[dict]:
        """The items of the conversation the request is in; a 400 for an input item already in it."""
        if request.previous_response_id is not None:
            raise RequestError("conversation: a response continues either a conversation or a previous response, "
                               "not both; leave previous_response_id out", param="conversation")
        context = await self.call("conversation", "context", request.conversation)
        clash = {item.id for item in request.input} & {item["id"] for item in context}
        if clash:
            raise RequestError(f"input: item {min(clash)!r} is already in the conversation, which the response "
                               "reads before its input; send only what is new", param="input")
        return context

    async def keep(self, response: dict, items: list[dict], rerun: dict | None = None, text: str | None = None
                   ) -> None:
        """`text`: the response's JSON (`json_text`), where the caller has it."""
        await self.call("put", await _stored(response, text), await encoded(items, json_text), rerun)

    async def end(self, response: dict, items: list[dict], turn: list[dict] | None, kept: bool,
                  text: str | None = None) -> None:
        """A response that ended: kept (`kept`: with the `items` it read) and, in a conversation
        (`turn`: its own input items), added to it."""
        if kept:
            await self.keep(response, items, text=text)
        await self._add_to_conversation(response, turn)

    async def ending(self, events: AsyncIterator[bytes], stream: ResponseEvents, items: list[dict],
                     turn: list[dict] | None, kept: bool) -> AsyncIterator[bytes]:
        """`events`, the stream's response ended (`end`) once it is whole, before its last events
        are sent (so a client that read them finds it)."""
        ended = False
        async for event in events:
            if stream.whole is not None and not ended:
                await self.end(stream.whole, items, turn, kept)
                ended = True
            yield event

    async def _add_to_conversation(self, response: dict, turn: list[dict] | None) -> None:
        """In a conversation, a response that completed (or was cut short) adds its input items
        (`turn`) and output to it. One that cannot (the conversation deleted meanwhile, or past the
        store's bounds) is still answered: logged, not raised."""
        if turn is None or response["status"] not in ("completed", "incomplete"):
            return
        conversation_id = response["conversation"]["id"]
        try:
            await self.call("conversation", "add", conversation_id, turn + response["output"])
        except Exception:
            log.exception("response %s could not be added to conversation %s", response["id"], conversation_id)

    async def run_in_background(self, pending: dict, items: list[dict], turn: list[dict] | None,
                                end: Callable[[], Awaitable[dict]], abort: Callable[[], Awaitable],
                                request: dict | None = None) -> dict:
        """`pending` (in progress) kept and returned; `end()` (the whole response, or a
        RequestFailed) runs on in a task that settles it (and adds it to its conversation, `turn`).
        With `request` (the Responses request it runs, as JSON), a replica may run it again should
        this one die. Not kept (the store unavailable): `abort()` stops the runs nobody would read,
        and the store's error is raised."""
        rerun = None if request is None else {"request": request, "turn": turn}
        await self._keep_or(abort, pending, items, rerun=rerun)
        self._run(pending, end(), turn)
        return pending

    async def stream_in_background(self, pending: dict, items: list[dict], turn: list[dict] | None,
                                   events: AsyncIterator[bytes], stream: ResponseEvents,
                                   abort: Callable[[], Awaitable]) -> AsyncIterator[bytes]:
        """`pending` kept (or `abort()`, as above); `events` (its stream) run on in a task that
        records them in the store, for any replica to stream again (`replay`), and settles it. What
        is returned streams them to the client that asked, who may go away without stopping them."""
        await self._keep_or(abort, pending, items, streams=True)
        recording = _Recording()
        self._run(pending, self._record(pending["id"], events, stream, recording), turn)
        return recording.read()

    async def replay(self, response_id: str, after: int, first: tuple[list[str], bool]) -> AsyncIterator[bytes]:
        """A background stream read again: `first` (the store's events after number `after`), then
        those recorded since, asked every RESUME_POLL_S, until the response ends or is gone."""
        answer = first
        while answer is not None:
            events, ended = answer
            for event in events:
                yield event.encode()
            after += len(events)
            if ended:
                return
            await asyncio.sleep(RESUME_POLL_S)
            try:
                answer = await self.call("events", response_id, after)
            except RequestError:  # a restarted store lost them: this stream ends, a new one reads them again
                return

    async def _keep_or(self, abort: Callable[[], Awaitable], pending: dict, items: list[dict],
                       streams: bool = False, rerun: dict | None = None) -> None:
        """`pending` kept (with an empty event record when it streams, so its stream can be read at
        once); `abort()` and the error raised when the store cannot keep it."""
        try:
            await self.keep(pending, items, rerun)
            if streams:
                await self.call("append_events", pending["id"], 0, [])
        except Exception:
            await abort()
            raise

    def _run(self, pending: dict, end: Awaitable[dict], turn: list[dict] | None) -> None:
        self._running[pending["id"]] = background(self._settle(pending, end, turn))
        if self._poller is None or self._poller.done():
            self._poller = background(self._stop_cancelled())

    async def _settle(self, pending: dict, end: Awaitable[dict], turn: list[dict] | None) -> None:
        try:
            try:
                whole = await end
            except RequestFailed as error:  # every attempt failed
                whole = _failed(pending, str(error))
            except Exception as error:
                log.exception("background response %s failed", pending["id"])
                whole = _failed(pending, f"the server failed answering it: {error!r}")
            if await self.call("settle", await _stored(whole)):  # not cancelled meanwhile
                await self._add_to_conversation(whole, turn)
        except Exception:
            log.exception("background response %s: its end could not be kept", pending["id"])
        finally:
            self._running.pop(pending["id"], None)

    async def _record(self, response_id: str, events: AsyncIterator[bytes], stream: ResponseEvents,
                      recording: _Recording) -> dict:
        """The whole response, once every event of `events` is in `recording` and in the store (sent
        every EVENT_FLUSH_S while it runs, the rest before the end is settled, so a reader that sees
        the end has every event)."""
        sent = 0

        async def send_every():
            nonlocal sent
            while True:
                await asyncio.sleep(EVENT_FLUSH_S)
                sent = await self._send(response_id, sent, recording.events)

        sender = asyncio.ensure_future(send_every())
        try:
            async with aclosing(events):
                async for event in events:
                    recording.add(event)
        finally:
            recording.end()
            sender.cancel()
            with suppress(asyncio.CancelledError):
                await sender
        await self._send(response_id, sent, recording.events)  # from before a send cut short: the store
        if stream.whole is None:  # keeps only what it lacks
            raise RuntimeError("the stream ended without its response")
        return stream.whole

    async def _send(self, response_id: str, sent: int, events: list[bytes]) -> int:
        """The events from number `sent` on, to the store; how many it holds (from where it stands
        when it holds fewer: a restarted store). On a failed call, `sent`: the next send retries."""
        try:
            held = await self.call("append_events", response_id, sent, [event.decode() for event in events[sent:]])
            if 0 <= held < sent:
                held = await self.call("append_events", response_id, held, [event.decode() for event in events[held:]])
            return held if held >= 0 else sent
        except Exception:
            log.exception("background stream %s: events could not be recorded", response_id)
            return sent

    async def _stop_cancelled(self) -> None:
        """While background responses run here: every CANCEL_POLL_S, one call asks the store which
        of them are no longer in progress (cancelled on any replica, deleted), and their tasks are
        cancelled, which stops their runs."""
        while self._running:
            await asyncio.sleep(CANCEL_POLL_S)
            ids = list(self._running)
            try:
                statuses = await self.call("statuses", ids)
            except Exception:
                log.exception("the response store could not be asked about %d background responses", len(ids))
                continue
            for response_id, status in zip(ids, statuses):
                if status != "in_progress" and response_id in self._running:
                    self._running[response_id].cancel()

    def _watch_orphans(self) -> None:
        """This replica's loop that adopts background responses whose replica died, started by its
        first call of the store (a poll of a response, from a client whose replica died, is one)."""
        if self.enabled and self._run_again is not None and (self._adopter is None or self._adopter.done()):
            self._adopter = background(self._adopt())

    async def _adopt(self) -> None:
        """Every ADOPT_POLL_S, the store's orphans run here, as if admitted here (`_run`)."""
        while True:
            await asyncio.sleep(ADOPT_POLL_S)
            try:
                orphans = await self._store.call("adopt", ADOPT_MOST)
            except Exception:
                log.exception("the response store could not be asked for background responses to adopt")
                continue
            for pending, rerun in orphans:
                pending = decoded(pending)
                if pending["id"] in self._running:  # still running here, only late to renew: it goes on
                    continue
                log.warning("background response %s lost the replica that ran it: run %d starts here",
                            pending["id"], rerun["runs"])
                self._run(pending, self._run_again(pending, rerun), rerun["turn"])

    async def call(self, method: str, *args):
        """The store's answer; a RequestError it raised (a bad page query) is raised here."""
        self._watch_orphans()
        try:
            return await self._store.call(method, *args)
        except RayTaskError as error:
            if isinstance(error.cause, RequestError):
                raise error.cause from None
            raise


class _Recording:
    """A background stream's events as this replica makes them, for the client that asked to read."""

    def __init__(self):
        self.events: list[bytes] = []
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, event: bytes) -> None:
        self.events.append(event)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    async def read(self) -> AsyncIterator[bytes]:
        sent = 0
        while True:
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.ended:
                return
            self._changed.clear()
            await self._changed.wait()


def continued(items: str, context: str) -> list[dict]:
    """What a continuation reads, from the store's `context` (the JSON of the items the response
    read, and `Stored.context`): those items, then its output."""
    return decoded(items) + decoded(context)["output"]


async def _stored(response: dict, text: str | None = None) -> Stored:
    """`response` as the store keeps it; `text`: its JSON (`json_text`), where the caller has it."""
    return Stored.of(response, await encoded(response, json_text) if text is None else text)


def _failed(pending: dict, message: str) -> dict:
    return {**pending, "status": "failed", "error": {"code": "server_error", "message": message}}


def _missing(response_id: str, param: str = "response_id") -> RequestError:
    return RequestError(f"{param}: no stored response {response_id!r} (never stored, deleted, or dropped to keep "
                        "the store within its bounds)", status=404, param=param)


async def _answer(request: Request, response_id: str, method: str) -> Response:
    """The store's answer, the response's JSON as the store has it; a 404 when it holds no such response."""
    try:
        found = await request.app.state.stored_responses.call(method, response_id)
    except RequestError as error:
        return error_response(error)
    if found is None:
        return error_response(_missing(response_id))
    return text_response(found)


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str, stream: bool = False, starting_after: int | None = None):
    """The response; with `stream`, a background one's events after `starting_after` (all of them
    without it), as they are recorded, until it ends."""
    if not stream:
        return await _answer(request, response_id, "get")
    stored, after = request.app.state.stored_responses, -1 if starting_after is None else starting_after
    try:
        first = await stored.call("events", response_id, after)
    except RequestError as error:
        return error_response(error)
    if first is None:
        return error_response(_missing(response_id))
    return StreamingResponse(stored.replay(response_id, after, first), media_type="text/event-stream")


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                      after: str | None = None):
    """A cursor page of the items the response read (OpenAI's default: newest first)."""
    try:
        found = await request.app.state.stored_responses.call("input_items", response_id)
        if found is None:
            return error_response(_missing(response_id))
        page = cursor_page(in_order(decoded(found)[::-1], order), limit, after, MAX_ITEMS_PAGE)
    except RequestError as error:
        return error_response(error)
    return await encoded(page, json_response)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(request: Request, response_id: str):
    return await _answer(request, response_id, "cancel")


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str):
    if not await request.app.state.stored_responses.call("delete", response_id):
        return error_response(_missing(response_id))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
