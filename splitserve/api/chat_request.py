"""OpenAI's `/v1/chat/completions` request: its messages (text content parts only, earlier tool
calls, an assistant's thinking), its tools and `tool_choice` (`allowed_tools` too), the chat
template's arguments, chat's own length and logprobs fields and a `prediction` (Predicted
Outputs), over the fields it shares with completions (`request_models.GenerationRequest`)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from splitserve.api.errors import RequestError
from splitserve.api.request_models import GenerationRequest, only_values
from splitserve.api.strict_model import STRICT
from splitserve.api.tool_calls import forced_call_constraint
from splitserve.api.tool_models import MAX_TOOLS, AllowedToolsChoice, AssistantToolCall, NamedToolChoice, Tool
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import MAX_LOGPROBS

RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "reasoning_effort")


def _text_parts(value):
    """Lets through a string, null, or a list of text parts; names the first other part type."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string, a list of content parts, or null")
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string field 'text'")
    return value


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in (value or {})]
    if reserved:
        raise ValueError(f"{reserved[0]!r} comes from the request's own field, not from chat_template_kwargs")
    return value


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part; keys that only annotate it are ignored."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts)]
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    # an assistant message's thinking, as a reasoning parser returned it (`reasoning_content`: vLLM's older name)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @property
    def thinking(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, value):
        """An assistant message that only calls tools may leave content out (OpenAI's clients do)."""
        if isinstance(value, dict) and value.get("tool_calls") and "content" not in value:
            return {**value, "content": None}
        return value


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text much of the answer is expected to repeat (a file being
    edited). It changes no token of the answer: where the server speculates, decodes draft from it."""
    model_config = STRICT
    type: Literal["content"]
    content: Annotated[str | list[TextPart], BeforeValidator(_text_parts)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    PROMPT_FIELD: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None
    tools: Annotated[list[Tool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None  # None: auto
    parallel_tool_calls: bool | None = None  # several calls in one answer when the model writes them; a forced one is one
    modalities: Annotated[list[str] | None, only_values(None, ["text"], reason="only text output is supported")] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the model goes on with the last message (a prefilled answer)
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # the chat template's variable (GPT-OSS's)
    prediction: Prediction | None = None
    # accepted and ignored, as the Responses API's: hints about caching and abuse monitoring, which ask
    # nothing of the output (the prefix cache finds shared prefixes itself and keeps them while memory allows)
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _continue_or_start_a_message(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message: the model continues the last message, so it needs "
                               "add_generation_prompt false (it would start a new one)", param="continue_final_message")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        choice = self.tool_choice
        named = {choice.function.name} if isinstance(choice, NamedToolChoice) else \
            choice.allowed_tools.names() if isinstance(choice, AllowedToolsChoice) else set()
        if choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice: needs tools", param="tool_choice")
        if unknown := named - {t.function.name for t in self.tools or ()}:
            raise RequestError(f"tool_choice: no tool is named {min(unknown)!r}", param="tool_choice")
        return self

    def tool_functions(self) -> list[dict]:
        """The functions offered (as templates see them); none with tool_choice none."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    def callable_functions(self) -> list[dict]:
        """The functions the model may call (as the constraint and the call parser see them): those
        offered, or the `allowed_tools` of them."""
        if isinstance(self.tool_choice, AllowedToolsChoice):
            allowed = self.tool_choice.allowed_tools.names()
            return [f for f in self.tool_functions() if f["name"] in allowed]
        return self.tool_functions()

    def output_constraint(self) -> tuple[OutputConstraint | None, str | None]:
        constraint, field = super().output_constraint()
        choice = self.tool_choice
        if isinstance(choice, (NamedToolChoice, AllowedToolsChoice)):
            choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice.allowed_tools.mode
        forced = forced_call_constraint(self.callable_functions(), choice) if self.tools else None
        if forced is None:
            return constraint, field
        if constraint is not None:
            raise RequestError(f"tool_choice: a forced tool call and {field} both constrain the output; "
                               "send one", param="tool_choice")
        return forced, "tool_choice"

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: only allowed when logprobs is true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise RequestError("max_tokens and max_completion_tokens are the same limit (the second is OpenAI's "
                               "newer name); set only one", param="max_tokens")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
