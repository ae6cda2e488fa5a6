"""What the ingress builds or encodes in a thread rather than on its event loop, where every other
stream of the replica would wait: a body or chunk carrying many tokens' logprobs (top 20 over 20k
tokens is 400k alternatives, each a dict to build and encode). Such a body is encoded in pieces
(`dumps_in_pieces`): one call of the C encoder would hold the GIL, and so the loop, throughout.
What the ingress decodes (what a continuation reads, a page of input items) is decoded on the
loop, with the collector paused when it is long."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar

from fastapi.responses import JSONResponse, Response

from splitserve.api.json_pieces import json_text
from splitserve.engine.collector import collector_paused

# A token's logprobs at top 5 take 30-55 us of Python to build for chat (2-core CPU, with garbage collection) and
# about 15 us to encode; a thread hop costs about 50 us, so smaller bodies stay on the loop.
LOGPROB_TOKENS_ON_LOOP = 256
# Text longer than this is decoded with the collector paused (the C decoder holds the GIL either way: no thread helps)
TEXT_CHARS_PAUSED = 1 << 16

T = TypeVar("T")


def logprob_tokens(body) -> int:
    """Tokens whose logprobs a body, chunk or event carries, wherever they sit: chat's and
    completions' choices, the Responses API's output text, its items and its stream events."""
    if isinstance(body, dict):
        return sum(_entries(value) if key == "logprobs" else logprob_tokens(value) for key, value in body.items())
    if isinstance(body, list):
        return sum(logprob_tokens(value) for value in body)
    return 0


def _entries(logprobs) -> int:
    """A `logprobs` value's tokens: a list of entries (chat's and the Responses API's shape), or
    completions' object (a list per field) or chat's (`content`, `refusal`)."""
    if isinstance(logprobs, list):
        return len(logprobs)
    if isinstance(logprobs, dict):
        return sum(len(logprobs.get(key) or ()) for key in ("tokens", "content", "refusal"))
    return 0


async def built(logprob_count: int, build: Callable[..., T], *args) -> T:
    """`build(*args)`, in a thread when it handles more than LOGPROB_TOKENS_ON_LOOP tokens' logprobs
    (the caller touches nothing `build` uses until it returns)."""
    if logprob_count <= LOGPROB_TOKENS_ON_LOOP:
        return build(*args)
    return await asyncio.to_thread(build, *args)


async def encoded(body: dict, encode: Callable[..., T]) -> T:
    """`encode(body)`; past the threshold, `encode(body, in_pieces=True)` in a thread."""
    if logprob_tokens(body) <= LOGPROB_TOKENS_ON_LOOP:
        return encode(body)
    return await asyncio.to_thread(encode, body, in_pieces=True)


def json_response(body: dict, in_pieces: bool = False) -> Response:
    """`JSONResponse(body)`; `in_pieces`: the same bytes, made by `dumps_in_pieces`."""
    if not in_pieces:
        return JSONResponse(body)
    return text_response(json_text(body, in_pieces=True))


def text_response(text: str) -> Response:
    """A JSON body the caller has as text already (a stored response)."""
    return Response(text.encode(), media_type="application/json")


def decoded(text: str):
    """`json.loads(text)`; a long text with the collector paused. Its values hold no cycles, and
    each full pass its many objects would start walks every object the process tracks."""
    if len(text) <= TEXT_CHARS_PAUSED:
        return json.loads(text)
    with collector_paused():
        return json.loads(text)
