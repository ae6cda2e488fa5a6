"""Stored responses in a cluster: the store (`api/response_store.py`) is one actor the controller
deployment owns, which every ingress replica reaches through `StoredResponses`; the routes that
read and delete them: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A response is kept when it ends (`store` not false and the store not sized 0): a whole one once
answered, a streamed one after its last event (a failed one too: its id was sent). A response a
client never got (a 4xx, a whole response that failed) is not."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from ray.exceptions import RayTaskError

from splitserve.api.errors import RequestError, error_response
from splitserve.api.responses_events import ResponseEvents
from splitserve.api.responses_request import ResponsesRequest

router = APIRouter()


class StoredResponses:
    def __init__(self, store_handle: Callable[[], Awaitable], enabled: bool):
        self._get_handle, self._handle, self.enabled = store_handle, None, enabled

    def keeps(self, request: ResponsesRequest) -> bool:
        return self.enabled and request.store is not False

    async def context(self, request: ResponsesRequest) -> list[dict]:
        """The conversation `previous_response_id` continues ([] when it names none)."""
        response_id = request.previous_response_id
        if response_id is None:
            return []
        if not self.enabled:
            raise RequestError("previous_response_id: this server keeps no responses (ingress.stored_responses "
                               "is 0); send the conversation in input", param="previous_response_id")
        context = await self.call("context", response_id)
        if context is None:
            raise _missing(response_id, "previous_response_id")
        return context

    async def keep(self, response: dict, items: list[dict]) -> None:
        await self.call("put", response, items)

    async def kept(self, events: AsyncIterator[bytes], stream: ResponseEvents, items: list[dict]
                   ) -> AsyncIterator[bytes]:
        """`events`, the stream's response kept once it is whole, before its last events are sent
        (so a client that read them finds it)."""
        kept = False
        async for event in events:
            if stream.whole is not None and not kept:
                await self.keep(stream.whole, items)
                kept = True
            yield event

    async def call(self, method: str, *args):
        """The store's answer; a RequestError it raised (a bad page query) is raised here."""
        if self._handle is None:
            self._handle = await self._get_handle()
        try:
            return await getattr(self._handle, method).remote(*args)
        except RayTaskError as error:
            if isinstance(error.cause, RequestError):
                raise error.cause from None
            raise


def _missing(response_id: str, param: str = "response_id") -> RequestError:
    return RequestError(f"{param}: no stored response {response_id!r} (never stored, deleted, or dropped to keep "
                        "the store within its bounds)", status=404, param=param)


async def _answer(request: Request, response_id: str, method: str, *args) -> JSONResponse:
    """The store's answer, a 404 when it holds no such response."""
    try:
        found = await request.app.state.stored_responses.call(method, response_id, *args)
    except RequestError as error:
        return error_response(error)
    return error_response(_missing(response_id)) if found is None else JSONResponse(found)


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str):
    return await _answer(request, response_id, "get")


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                      after: str | None = None):
    return await _answer(request, response_id, "input_items", limit, order, after)


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str):
    if not await request.app.state.stored_responses.call("delete", response_id):
        return error_response(_missing(response_id))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
