"""One ASGI middleware in front of every route: the API key, the body-size bounds, and OpenAI's
error body for a route's own failure; `guard(app)` installs it, and answers FastAPI's own refusals
in OpenAI's shape too.

- The key (`app.state.api_key`; None: no authentication) is required on every route but the open
  ones (`/health` for probes, `/metrics` for scrapes), compared in constant time. A wrong or
  missing key is a 401 with OpenAI's error body, before the route runs (so before its body is read).
- A body larger than its bound (`app.state.limits`: uploads to /v1/files have their own) is a 413:
  at once when Content-Length says so, or as soon as a streamed body passes the bound.
- An exception a route does not turn into a response (a bug, a full disk) is logged with its
  traceback and answered with a 500 in OpenAI's shape (`server_error`), not the server's bare text;
  once a response has started (a stream), it ends the response instead. A RequestError a route
  raises (a 503 while an actor it needs restarts) is answered as that error.
- A query or path value that does not parse (`?limit=ten`) is a 400 naming it (FastAPI's is a 422
  of its own shape); an unknown route is a 404 and a wrong method a 405, with OpenAI's body.
"""
from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from splitserve.api.errors import RequestError, error_body, error_response
from splitserve.api.limits import RequestLimits

OPEN_PATHS = frozenset({"/health", "/metrics"})
UPLOAD_PREFIX = "/v1/files"
log = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    pass


def guard(app: FastAPI) -> FastAPI:
    """`app` behind ApiGuard, with FastAPI's own refusals answered in OpenAI's shape."""
    app.add_middleware(ApiGuard)
    app.add_exception_handler(RequestValidationError, _unparsed_value)
    app.add_exception_handler(HTTPException, _refused)
    app.add_exception_handler(RequestError, _raised)
    return app


async def _unparsed_value(request: Request, error: RequestValidationError):
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"][1:]) or None  # loc: ("query", "limit")
    return error_response(RequestError(f"{param}: {first['msg']}", param=param))


async def _raised(request: Request, error: RequestError):
    """A RequestError a route did not catch (an actor it needs is restarting, say): its answer."""
    return error_response(error)


async def _refused(request: Request, error: HTTPException):
    return error_response(RequestError(f"{error.detail} ({request.method} {request.url.path})",
                                       status=error.status_code), headers=error.headers)


class ApiGuard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = scope["app"].state, _route_path(scope)
        if path not in OPEN_PATHS and not _authorized(scope, getattr(state, "api_key", None)):
            return await _send_error(send, RequestError("Incorrect or missing API key (send Authorization: Bearer "
                                                        "<key>)", status=401, code="invalid_api_key"))
        limits: RequestLimits = getattr(state, "limits", None) or RequestLimits()
        upload = path.startswith(UPLOAD_PREFIX)
        bound = limits.max_upload_bytes if upload else limits.max_request_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > bound:
            return await _send_error(send, _too_large(bound))
        received, started = 0, False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > bound:
                    raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise
            await _send_error(send, _too_large(bound))
        except Exception as error:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), path)
            await _send_error(send, RequestError(f"the server failed on this request ({type(error).__name__}); its "
                                                 "log has the cause", status=500, type="server_error"))


def _route_path(scope) -> str:
    """The path the app routes on: the request's, less the prefix the app is mounted at (Serve's
    route_prefix arrives as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _too_large(bound: int) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit of {bound} bytes", status=413,
                        code="request_too_large")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _authorized(scope, key: str | None) -> bool:
    if key is None:
        return True
    given = _header(scope, b"authorization") or ""
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


async def _send_error(send, error: RequestError) -> None:
    body = json.dumps(error_body(error)).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
