"""OpenAI's `/v1/responses` request, taken as the chat completion it asks for: `to_chat` turns its
instructions and input items into chat messages, its function tools, `text.format` and
`reasoning.effort` into the chat fields, so one validated path (`prepare_request("chat", ...)`)
tokenizes and bounds both. A chat field a refusal names is named back as this request's field
(`chat_param`).

A request that names `previous_response_id` continues a stored response (`response_store`): the
conversation that response read and its output come before this request's `input`
(`continuing`); its instructions do not carry over, as OpenAI's do not. One that names a
`conversation` reads that conversation's items first (`conversation_store`) and adds its input and
output to it once it ends. A `background` one is
answered at once, in progress, and kept when it ends (`stored_responses`).
Input is text: an image or file part is a 400 naming it. `include: ["message.output_text.logprobs"]`
(with `top_logprobs` alternatives) asks chat's `logprobs`. A reasoning item sent back in `input` is
the thinking of the assistant turn it precedes, as the chat template sees an assistant message's
`reasoning`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from splitserve.api.errors import RequestError
from splitserve.api.request_models import Metadata, only_values
from splitserve.api.strict_model import STRICT
from splitserve.api.tool_models import MAX_TOOLS, FunctionDefinition
from splitserve.engine.sampling_params import MAX_LOGPROBS

MAX_INPUT_ITEMS = 2048  # every item is a chat message at most: the chat bounds (max_chat_messages) apply too
MAX_ID_CHARS = 256
LOGPROBS = "message.output_text.logprobs"


class InputText(BaseModel):
    """A text part of an input message (`input_text`; `output_text` in an earlier answer)."""
    model_config = ConfigDict(extra="ignore", strict=True)  # an output_text's annotations and logprobs say nothing
    type: Literal["input_text", "output_text"]
    text: str


def _text_parts(value):
    """Names the first part that is not text (an image, a file) rather than pydantic's union error."""
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text"):
            raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
    return value


TextContent = Annotated[str | list[InputText], BeforeValidator(_text_parts)]


class Item(BaseModel):
    """An input item; one an earlier response output and the client sent back has its id and status."""
    model_config = STRICT
    id: str | None = None
    status: str | None = None


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextContent
    phase: Literal["commentary", "final_answer"] | None = None  # OpenAI's label of an assistant message: the
    # chat template has no place for it, so a conversation renders the same with or without

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


NOT_HOSTED = "this server runs no tools itself: a call is the model's, made directly"


class FunctionCallItem(Item):
    """A call the model made in an earlier turn. OpenAI's hosted-tool fields are taken when they
    say nothing (null), as a client that serializes an earlier output whole sends them."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Annotated[str | None, only_values(None, reason=NOT_HOSTED)] = None
    caller: Annotated[dict | None, only_values(None, reason=NOT_HOSTED)] = None
    run_async: Annotated[bool | None, only_values(None, False, reason=NOT_HOSTED)] = Field(None, alias="async")


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: TextContent

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[str | None, only_values(None, reason="this server writes no encrypted reasoning")
                                 ] = None

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


def _typed(item):
    """A message may leave its type out (`{"role": "user", "content": "Hi"}`, as clients send it)."""
    return {**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item else item


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type"), BeforeValidator(_typed)]


_ITEMS = TypeAdapter(list[InputItem])


def _as_items(value):
    """A string input is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(FunctionDefinition):
    """A function offered, as the Responses API spells it (chat's definition with its type beside)."""
    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, value):
        """Names a hosted tool (web_search, file_search, ...) rather than the fields it lacks."""
        kind = value.get("type") if isinstance(value, dict) else None
        if kind != "function":
            raise ValueError(f"only function tools are supported, got a tool of type {kind!r}")
        return value


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class AllowedFunctions(BaseModel):
    """The functions the model may call, of those offered (chat's `allowed_tools`)."""
    model_config = STRICT
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedFunction], Field(min_length=1, max_length=MAX_TOOLS)]


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    model_config = STRICT
    effort: Literal["low", "medium", "high"] | None = None
    summary: Annotated[str | None, only_values(None, reason="this server writes no reasoning summaries")] = None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = None


def _conversation_id(value):
    """A conversation is named by its id or by an object holding only it (`{"id": ...}`)."""
    if isinstance(value, dict):
        if set(value) != {"id"}:
            raise ValueError('must be a conversation id or {"id": <conversation id>}')
        return value["id"]
    return value


class ResponsesRequest(BaseModel):
    model_config = STRICT
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_as_items), Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    stream: bool | None = False
    tools: Annotated[list[FunctionTool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | AllowedFunctions | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: bool | None = None  # keep the response (OpenAI's default), where this server keeps responses
    previous_response_id: Annotated[str | None, Field(max_length=MAX_ID_CHARS)] = None
    conversation: Annotated[str | None, BeforeValidator(_conversation_id), Field(max_length=MAX_ID_CHARS)] = None
    background: bool | None = None
    # accepted and ignored, as chat's: they ask nothing of the output (prefix caching needs no key)
    metadata: Metadata = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    max_tool_calls: Annotated[int | None, Field(ge=1)] = None  # bounds hosted-tool calls: this server runs none
    stream_options: StreamOptions | None = None  # this server sends no `obfuscation` padding either way
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: first turns dropped to fit (`prepare_responses`)
    include: Annotated[list[Annotated[str, only_values(LOGPROBS, reason=f"only {LOGPROBS!r} is supported")]] | None,
                       Field(max_length=8)] = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    cache_salt: str | None = None  # vLLM's, as chat's
    priority: int = 0  # vLLM's, as chat's

    def wants_logprobs(self) -> bool:
        """The output text's logprobs were asked for (`include`, or alternatives in `top_logprobs`)."""
        return LOGPROBS in (self.include or ()) or bool(self.top_logprobs)

    def turn_starts(self) -> list[int]:
        """Where the input's turns after the first start: each message that is not the assistant's."""
        return [k for k, item in enumerate(self.input)
                if k and isinstance(item, MessageItem) and item.role != "assistant"]

    def without_first(self, count: int) -> ResponsesRequest:
        return self.model_copy(update={"input": self.input[count:]})

    def continuing(self, context: list[dict]) -> ResponsesRequest:
        """This request with `context` (a stored response's conversation items) before its input."""
        items = _ITEMS.validate_python(context)
        return self.model_copy(update={"input": items + self.input}) if items else self

    def to_chat(self) -> dict[str, Any]:
        """The chat completions body this request asks for."""
        chat = {"model": self.model, "messages": self.messages(), "temperature": self.temperature,
                "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls, "metadata": self.metadata, "user": self.user,
                "store": self.store, "service_tier": self.service_tier, "cache_salt": self.cache_salt,
                "priority": self.priority or None,
                "reasoning_effort": self.reasoning and self.reasoning.effort}
        if self.wants_logprobs():
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif isinstance(self.tool_choice, AllowedFunctions):
            chat["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {"mode": self.tool_choice.mode, "tools": [
                {"type": "function", "function": {"name": tool.name}} for tool in self.tool_choice.tools]}}
        else:
            chat["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = _response_format(self.text.format)
        return {key: value for key, value in chat.items() if value is not None}

    def messages(self) -> list[dict]:
        """Instructions as the system message, then the input's items as chat messages: an assistant
        turn's reasoning, text and calls (consecutive items) make one assistant message."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        turn: dict | None = None  # the assistant message being gathered
        for item in self.input:
            if isinstance(item, (ReasoningItem, FunctionCallItem)) or (isinstance(item, MessageItem)
                                                                        and item.role == "assistant"):
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    messages.append(turn)
                _add_to_turn(turn, item)
                continue
            turn = None
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                messages.append({"role": item.role, "content": item.text()})
        return messages


def _add_to_turn(turn: dict, item: ReasoningItem | FunctionCallItem | MessageItem) -> None:
    if isinstance(item, ReasoningItem):
        turn["reasoning"] = turn.get("reasoning", "") + item.text()
    elif isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        turn.setdefault("tool_calls", []).append(call)
    else:
        turn["content"] = (turn["content"] or "") + item.text()


def _response_format(text_format: TextFormat) -> dict:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = {"name": text_format.name, "schema": text_format.schema_, "description": text_format.description,
              "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


# the chat field a refusal names -> this request's
_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("reasoning_effort", "reasoning.effort"), ("tools", "tools"), ("logprobs", "include"))


def chat_param(param: str | None) -> str | None:
    """The field of a Responses request that a refusal of its chat body names (`messages.2.content`
    is somewhere in `input`; `tools.0.function.name` is `tools.0.name`)."""
    if param is None:
        return None
    for chat, ours in _PARAMS:
        if param == chat or param.startswith(chat + "."):
            if chat == "messages":
                return ours
            return ours + param[len(chat):].replace(".function.", ".").replace(".json_schema.", ".")
    return param


def as_responses_error(error: RequestError) -> RequestError:
    """A refusal of the chat body, naming this request's field instead of the chat one."""
    param = chat_param(error.param)
    message = error.message
    if error.param is not None and message.startswith(error.param):
        message = param + message[len(error.param):]
    return RequestError(message, error.status, param, error.type, error.code)

