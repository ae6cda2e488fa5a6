"""Request builders shared by the API request tests."""
import json

import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest, parse_request

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "demo", "prompt": "hello"}


def refusal(model_cls, body) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        parse_request(model_cls, raw)
    return info.value


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({**COMPLETION, **fields}).encode())


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())
