"""Bounds on what one request may ask of the server, checked before any tokenization: a request
over a size bound is a 413, over a count bound a 400, each naming the field. The values come from
the cluster config (`ingress.*`); the defaults are the config's."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest, GenerationRequest


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 4 << 20
    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_chat_messages: int = 1024
    max_prompts: int = 128
    max_upload_bytes: int = 200 << 20
    max_batch_lines: int = 50_000
    priorities: bool = False  # the engines schedule by priority: a request may send a non-zero one

    def check(self, request: GenerationRequest) -> None:
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        _at_most(len(stops), self.max_stop_strings, "stop", "stop strings")
        longest = max((len(s) for s in stops), default=0)
        _at_most(longest, self.max_stop_string_chars, "stop", "characters in a stop string")
        _at_most(len(request.stop_token_ids or ()), self.max_stop_token_ids, "stop_token_ids", "stop token ids")
        if request.priority and not self.priorities:
            raise RequestError("priority: this server schedules first come, first served "
                               "(engine.scheduling_policy: fcfs); a request's priority must be 0", param="priority")
        if isinstance(request, ChatCompletionRequest):
            _at_most(len(request.messages), self.max_chat_messages, "messages", "messages")
            chars = sum(_content_chars(m.content) + len(m.thinking or "") for m in request.messages)
            _at_most(chars, self.max_prompt_chars, "messages", "characters of message content", status=413)
            if request.prediction is not None:
                _at_most(len(request.prediction.text), self.max_prompt_chars, "prediction", "characters of prediction",
                         status=413)
        elif isinstance(request, CompletionRequest):
            self.check_prompts(request.prompts(), "prompt")

    def check_prompts(self, prompts: list[str | list[int]], field: str) -> None:
        """A request's prompts (a completion's, an embedding's inputs): how many, and their text."""
        _at_most(len(prompts), self.max_prompts, field, "prompts")
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        _at_most(chars, self.max_prompt_chars, field, "prompt characters", status=413)


def _content_chars(content) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content)


def _at_most(value: int, bound: int, field: str, what: str, status: int = 400) -> None:
    if value > bound:
        raise RequestError(f"{field}: {value} {what}, more than this server's limit of {bound}", status=status,
                           param=field, code="request_too_large" if status == 413 else None)
