"""OpenAI's Conversations API in a cluster: POST /v1/conversations; GET, POST (its metadata) and
DELETE /v1/conversations/{id}; POST and GET /v1/conversations/{id}/items; GET and DELETE
/v1/conversations/{id}/items/{item_id}. The conversations are kept by the response store's actor
(`api/conversation_store.py`), which every ingress replica reaches through `StoredResponses`, so a
response created with `conversation` on any replica reads and extends the same one."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from splitserve.api.conversation_requests import MetadataUpdate, NewConversation, NewItems, check_include
from splitserve.api.errors import RequestError, error_response
from splitserve.api.request_models import parse_request
from splitserve.api.responses_bodies import stored_items
from splitserve.api.responses_request import LOGPROBS

router = APIRouter()


async def _answer(request: Request, method: str, *args) -> JSONResponse:
    """The store's answer; its RequestError (a 404 for a conversation or item it does not hold)
    as an error body."""
    try:
        return JSONResponse(await request.app.state.stored_responses.call("conversation", method, *args))
    except RequestError as error:
        return error_response(error)


def _logprobs(request: Request) -> bool:
    """Whether `include` asks for the output texts' logprobs (the openai client sends `include[]=...`);
    a RequestError for a bad one."""
    include = request.query_params.getlist("include") + request.query_params.getlist("include[]")
    check_include(include)
    return LOGPROBS in include


@router.post("/v1/conversations")
async def create(request: Request):
    try:
        body = parse_request(NewConversation, await request.body())
    except RequestError as error:
        return error_response(error)
    return await _answer(request, "create", body.metadata or {}, stored_items(body.items or []))


@router.get("/v1/conversations/{conversation_id}")
async def retrieve(request: Request, conversation_id: str):
    return await _answer(request, "get", conversation_id)


@router.post("/v1/conversations/{conversation_id}")
async def update(request: Request, conversation_id: str):
    try:
        body = parse_request(MetadataUpdate, await request.body())
    except RequestError as error:
        return error_response(error)
    return await _answer(request, "update", conversation_id, body.metadata or {})


@router.delete("/v1/conversations/{conversation_id}")
async def delete(request: Request, conversation_id: str):
    return await _answer(request, "delete", conversation_id)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(request: Request, conversation_id: str):
    try:  # the items added are answered as sent: they hold no logprobs to include
        _logprobs(request)
        body = parse_request(NewItems, await request.body())
    except RequestError as error:
        return error_response(error)
    return await _answer(request, "add", conversation_id, stored_items(body.items))


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(request: Request, conversation_id: str, limit: int = 20, order: str = "desc",
                     after: str | None = None):
    try:
        logprobs = _logprobs(request)
    except RequestError as error:
        return error_response(error)
    return await _answer(request, "items", conversation_id, limit, order, after, logprobs)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(request: Request, conversation_id: str, item_id: str):
    try:
        logprobs = _logprobs(request)
    except RequestError as error:
        return error_response(error)
    return await _answer(request, "item", conversation_id, item_id, logprobs)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(request: Request, conversation_id: str, item_id: str):
    return await _answer(request, "delete_item", conversation_id, item_id)
