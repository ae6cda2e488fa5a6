"""What the ingress builds or encodes in a thread rather than on its event loop, where every other
stream of the replica would wait: a body or chunk carrying many tokens' logprobs (top 20 over 20k
tokens is 400k alternatives, each a dict to build and encode)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

# Building or encoding a token's logprobs is pure Python (30-55 us a token at top 5 for chat on a 2-core CPU,
# with garbage collection); a thread hop costs about 50 us, so smaller bodies stay on the loop.
LOGPROB_TOKENS_ON_LOOP = 256

T = TypeVar("T")


def logprob_tokens(body: dict) -> int:
    """Tokens whose logprobs a response body or stream chunk carries, over its choices."""
    total = 0
    for choice in body.get("choices", ()):
        logprobs = choice.get("logprobs") or {}
        total += sum(len(logprobs.get(key) or ()) for key in ("tokens", "content", "refusal"))
    return total


async def built(logprob_count: int, build: Callable[..., T], *args) -> T:
    """`build(*args)`, in a thread when it handles more than LOGPROB_TOKENS_ON_LOOP tokens' logprobs
    (the caller touches nothing `build` uses until it returns)."""
    if logprob_count <= LOGPROB_TOKENS_ON_LOOP:
        return build(*args)
    return await asyncio.to_thread(build, *args)
