"""The batch API's HTTP routes, OpenAI's shapes: /v1/files (multipart upload, list, retrieve,
content, delete) and /v1/batches (create, list, retrieve, cancel). They call the service found
at `app.state.batches` (the `BatchService`, or a proxy to it with the same async interface); the
app's `ApiGuard` checks the key and bounds the upload's size before they run."""
from __future__ import annotations

import inspect

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from splitserve.api.errors import RequestError, error_response
from splitserve.api.request_models import parse_request
from splitserve.batch.store import NotFound

router = APIRouter()


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict | None = None
    output_expires_after: dict | None = None


async def _call(request: Request, method: str, *args):
    """The service's answer as JSON (or raw bytes), or the OpenAI error response."""
    try:
        result = getattr(request.app.state.batches, method)(*args)
        result = await result if inspect.isawaitable(result) else result
    except RequestError as error:
        return error_response(error)
    except NotFound as missing:
        return error_response(RequestError(missing.message, status=404, param="id"))
    if isinstance(result, bytes):
        return Response(result, media_type="application/octet-stream")
    return JSONResponse(result)


@router.post("/v1/files")
async def create_file(request: Request):
    try:
        form = await request.form()
    except (ValueError, AssertionError) as error:
        return error_response(RequestError(f"expected a multipart form with file and purpose: {error}"))
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        return error_response(RequestError("file: missing (send it as a multipart file field)", param="file"))
    if not isinstance(purpose, str):
        return error_response(RequestError("purpose: missing", param="purpose"))
    policy = {key: form.get(f"expires_after[{key}]") for key in ("anchor", "seconds")}  # OpenAI's client nests so
    return await _call(request, "create_file", await upload.read(), upload.filename or "upload.jsonl", purpose,
                       policy if any(value is not None for value in policy.values()) else None)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, limit: int | None = None,
                     after: str | None = None, order: str = "desc"):
    return await _call(request, "list_files", purpose, limit, after, order)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str):
    return await _call(request, "get_file", file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    return await _call(request, "file_content", file_id)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    return await _call(request, "delete_file", file_id)


@router.post("/v1/batches")
async def create_batch(request: Request):
    try:
        body = parse_request(BatchCreate, await request.body())
    except (RequestError, ValidationError) as error:
        return error_response(error if isinstance(error, RequestError) else RequestError(str(error)))
    return await _call(request, "create_batch", body.input_file_id, body.endpoint, body.completion_window,
                       body.metadata, body.output_expires_after)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int | None = None, after: str | None = None):
    return await _call(request, "list_batches", limit, after)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    return await _call(request, "get_batch", batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    return await _call(request, "cancel_batch", batch_id)
