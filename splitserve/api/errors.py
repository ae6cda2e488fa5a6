"""A request the server refuses, and OpenAI's error body for it (the shape the `openai` client
raises from: {"error": {"message", "type", "param", "code"}})."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class RequestError(Exception):
    """A request the server refuses: HTTP status + OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code


def error_body(error: RequestError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_response(error: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)
