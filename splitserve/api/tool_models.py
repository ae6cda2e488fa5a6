"""The tool fields of a chat request: the functions offered, the choice among them, and the calls an
assistant made earlier in the conversation (OpenAI's shapes)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from splitserve.api.strict_model import STRICT

MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the schema is enforced when the call is forced, strict or not


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # a JSON object's text


class AssistantToolCall(BaseModel):
    """A call the assistant made earlier in the conversation."""
    model_config = STRICT
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChosenFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: ChosenFunction


class AllowedTools(BaseModel):
    """The tools the model may call, of those offered: all of them stay in the prompt (as OpenAI's
    do, so a prompt cached with them still matches); `mode` as tool_choice's "auto" or "required"."""
    model_config = STRICT
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1, max_length=MAX_TOOLS)]

    def names(self) -> set[str]:
        return {tool.function.name for tool in self.tools}


class AllowedToolsChoice(BaseModel):
    model_config = STRICT
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools
