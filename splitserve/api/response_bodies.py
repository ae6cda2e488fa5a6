"""OpenAI response bodies, stream chunks and error bodies as plain dicts, in the shapes the official
`openai` client parses, and their server-sent-events framing."""
from __future__ import annotations

import json
import uuid
from typing import Literal

from splitserve.api.errors import RequestError, error_body
from splitserve.api.json_pieces import dumps_in_pieces
from splitserve.api.request_models import ModelNames, ServedModels
from splitserve.api.usage import Usage

FinishReason = Literal["stop", "length", "tool_calls"]
SSE_DONE: bytes = b"data: [DONE]\n\n"
CHUNK_OBJECTS = {"completion": "text_completion", "chat": "chat.completion.chunk"}
ID_PREFIXES = {"completion": "cmpl", "chat": "chatcmpl", "embedding": "embd"}


def new_request_id(kind: Literal["completion", "chat", "embedding"]) -> str:
    return f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}"


def _envelope(object_name: str, request_id: str, model: str, created: int, choices: list[dict]) -> dict:
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": choices}


def completion_choice(text: str, finish_reason: FinishReason | None, logprobs: dict | None = None,
                      index: int = 0) -> dict:
    """`logprobs`: `logprob_bodies.completion_logprobs` of this text's tokens, when asked for."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(content: str | None, finish_reason: FinishReason, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None, index: int = 0, reasoning: str | None = None) -> dict:
    """`tool_calls`: the calls' bodies (`ToolCall.body()`), with the content written before them
    (or null); `reasoning`: a reasoning model's thinking (`reasoning_content` too, vLLM's older name)."""
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {}),
               **_reasoning(reasoning)}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _reasoning(text: str | None) -> dict:
    return {} if text is None else {"reasoning": text, "reasoning_content": text}


def response_body(kind: Literal["completion", "chat"], request_id: str, model: str, created: int, choices: list[dict],
                  usage: Usage) -> dict:
    """A whole response of one or several choices (`n`)."""
    body = _envelope("text_completion" if kind == "completion" else "chat.completion", request_id, model, created,
                     choices)
    return {**body, "usage": usage.body()}


def completion_response(request_id: str, model: str, created: int, text: str, finish_reason: FinishReason,
                        usage: Usage, logprobs: dict | None = None) -> dict:
    return response_body("completion", request_id, model, created, [completion_choice(text, finish_reason, logprobs)],
                         usage)


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: FinishReason | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    return _envelope("text_completion", request_id, model, created,
                     [completion_choice(text, finish_reason, logprobs, index)])


def chat_response(request_id: str, model: str, created: int, content: str | None, finish_reason: FinishReason,
                  usage: Usage, logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    return response_body("chat", request_id, model, created, [chat_choice(content, finish_reason, logprobs, tool_calls)],
                         usage)


def chat_chunk(request_id: str, model: str, created: int, *, role: str | None = None, content: str | None = None,
               finish_reason: FinishReason | None = None, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None, index: int = 0, reasoning: str | None = None) -> dict:
    """One stream chunk; its delta holds only what is given (the last chunk's delta is `{}`).
    `tool_calls`: OpenAI's streamed pieces of calls, each with its `index`."""
    delta = {key: value for key, value in (("role", role), ("content", content), ("tool_calls", tool_calls))
             if value is not None} | _reasoning(reasoning)
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope("chat.completion.chunk", request_id, model, created, [choice])


def usage_chunk(kind: Literal["completion", "chat"], request_id: str, model: str, created: int, usage: Usage) -> dict:
    """The chunk sent before `[DONE]` when `stream_options.include_usage` is set: no choices."""
    body = _envelope(CHUNK_OBJECTS[kind], request_id, model, created, [])
    return {**body, "usage": usage.body()}


# Characters JSON may leave raw but that str.splitlines (and clients that split a stream or a JSONL
# file with it, httpx's iter_lines among them) takes for line ends: escaped, so a line stays one.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line_json(data, separators: tuple[str, str] | None = None) -> str:
    """`data` as JSON text (UTF-8 left raw) that every line splitter reads as one line."""
    return json.dumps(data, ensure_ascii=False, separators=separators).translate(_LINE_BREAKING)


def sse_event(data: dict, in_pieces: bool = False) -> bytes:
    """`in_pieces`: the JSON made by `dumps_in_pieces` (a large event, encoded in a thread)."""
    text = dumps_in_pieces(data, _compact_line) if in_pieces else _compact_line(data)
    return b"data: " + text.encode() + b"\n\n"


def _compact_line(data) -> str:
    return one_line_json(data, (",", ":"))


def sse_error(error: RequestError) -> bytes:
    """An error inside a stream that already answered 200, as OpenAI and vLLM send it."""
    return sse_event(error_body(error))


def models_list(models: ModelNames, created: int, owned_by: str = "splitserve",
                max_model_len: int | None = None) -> dict:
    """`/v1/models`: one entry per name (aliases of one model), then one per LoRA adapter."""
    served = ServedModels.of(models)
    return {"object": "list", "data": [model_card(name, created, owned_by, max_model_len, served)
                                       for name in served.all]}


def model_card(name: str, created: int, owned_by: str = "splitserve", max_model_len: int | None = None,
               served: ServedModels | None = None) -> dict:
    """One model object (`/v1/models/{model}`); `max_model_len` is vLLM's extra field, and so is an
    adapter's `parent`, the base model's first name."""
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    if served is not None and name in served.adapters:
        extra["parent"] = served.names[0]
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by, **extra}
