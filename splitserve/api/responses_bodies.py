"""OpenAI's Response object and its output items, made from the chat choice that answered a
`/v1/responses` request: the choice's reasoning is a `reasoning` item, its text a `message` item
(one `output_text` part), each of its tool calls a `function_call` item, in that order. A choice
cut by the length limit makes the response `incomplete` (`max_output_tokens`)."""
from __future__ import annotations

import uuid

from splitserve.api.responses_request import (
    AllowedFunctions,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
)
from splitserve.api.usage import Usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(request: ResponsesRequest, response_id: str, created: int, status: str, output: list[dict],
                    usage: Usage | None = None, error: dict | None = None, stored: bool = False) -> dict:
    """The Response object in `status` ("in_progress", "completed", "incomplete", "failed"); it
    repeats the request's settings as OpenAI's does; `stored`: whether this server keeps it."""
    choice = request.tool_choice
    text_format = request.text.format if request.text is not None and request.text.format is not None else None
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
        "background": bool(request.background),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": request.model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "conversation": {"id": request.conversation} if request.conversation is not None else None,
        "reasoning": {"effort": request.reasoning and request.reasoning.effort, "summary": None},
        "store": stored, "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                 else {"type": "text"}},
        "tool_choice": choice.model_dump() if isinstance(choice, (NamedFunction, AllowedFunctions))
        else choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "truncation": request.truncation or "disabled", "usage": None if usage is None else usage.input_output_body(),
        "metadata": request.metadata or {}, "user": request.user,
    }


def response_of_choice(request: ResponsesRequest, response_id: str, created: int, choice: dict, usage: Usage,
                       stored: bool = False) -> dict:
    """The whole Response answering `request`, from the one chat choice computed for it."""
    return response_object(request, response_id, created, status_of(choice["finish_reason"]), output_items(choice),
                           usage, stored=stored)


def response_from_chat(request: ResponsesRequest, body: dict) -> dict:
    """The whole Response answering `request`, from the chat completion body computed for it."""
    [choice] = body["choices"]
    return response_of_choice(request, new_id("resp"), body["created"], choice, Usage.from_body(body["usage"]))


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    """An assistant message; `text` None: its part is not opened yet (a stream's first event)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    """`logprobs`: chat's logprobs `content` entries, the same shape (token, logprob, bytes, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def read_back(items: list[dict]) -> list[dict]:
    """Items (a response's output, a conversation's) as a prompt reads them: their output texts without
    the logprobs, which no prompt holds (20k tokens' at top 5 are 5.4 MB of JSON); `items` itself
    when none has any."""
    if not any(part.get("logprobs") for item in items if item.get("type") == "message" for part in item["content"]):
        return items
    return [{**item, "content": [_without_logprobs(part) for part in item["content"]]} if item.get("type") == "message"
            else item for item in items]


def _without_logprobs(part: dict) -> dict:
    return {**part, "logprobs": []} if part.get("logprobs") else part


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(choice: dict) -> list[dict]:
    """A whole chat choice's message as output items."""
    message, status = choice["message"], status_of(choice["finish_reason"])
    items = []
    if message.get("reasoning") is not None:
        items.append(reasoning_item(new_id("rs"), message["reasoning"], "completed"))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(new_id("msg"), message["content"], status, logprobs))
    items += [function_call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                                 "completed") for call in message.get("tool_calls") or ()]
    return items


def input_items(request: ResponsesRequest) -> list[dict]:
    """The request's own input as the items a stored response lists (`stored_items`)."""
    return stored_items(request.input)


def stored_items(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]) -> list[dict]:
    """Input items as a store keeps them (a response's, a conversation's), each with an id (its own if
    it came back from an earlier output) and its text as content parts."""
    return [_input_item(item, item.status or "completed") for item in items]


def _input_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, status: str) -> dict:
    if isinstance(item, MessageItem):
        parts = [(item.content, "output_text" if item.role == "assistant" else "input_text")] if isinstance(
            item.content, str) else [(part.text, part.type) for part in item.content]
        return {"type": "message", "id": item.id or new_id("msg"), "role": item.role, "status": status,
                "content": [output_text(text) if kind == "output_text" else {"type": kind, "text": text}
                            for text, kind in parts], **({"phase": item.phase} if item.phase else {})}
    if isinstance(item, FunctionCallItem):
        return function_call_item(item.id or new_id("fc"), item.call_id, item.name, item.arguments, status)
    if isinstance(item, FunctionCallOutputItem):
        return {"type": "function_call_output", "id": item.id or new_id("fco"), "call_id": item.call_id,
                "output": item.text(), "status": status}
    return reasoning_item(item.id or new_id("rs"), item.text(), status)
