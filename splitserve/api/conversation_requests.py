"""The bodies of OpenAI's Conversations API (`/v1/conversations`): a new conversation's items and
metadata, the items added to one (input items, as a Responses request takes them; at most
MAX_ITEMS_ADDED per call, OpenAI's bound), a metadata update; and the `include` a listing may ask."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from splitserve.api.errors import RequestError
from splitserve.api.request_models import Metadata
from splitserve.api.responses_request import LOGPROBS, InputItem
from splitserve.api.strict_model import STRICT

MAX_ITEMS_ADDED = 20


class NewConversation(BaseModel):
    model_config = STRICT
    items: Annotated[list[InputItem] | None, Field(max_length=MAX_ITEMS_ADDED)] = None
    metadata: Metadata = None


class NewItems(BaseModel):
    model_config = STRICT
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_ADDED)]


class MetadataUpdate(BaseModel):
    model_config = STRICT
    metadata: Metadata  # required; null clears it


def check_include(include: list[str] | None) -> None:
    """An assistant message's logprobs (kept when its response asked for them) are listed only when
    `include` asks for them; nothing else can be included."""
    for value in include or ():
        if value != LOGPROBS:
            raise RequestError(f"include: only {LOGPROBS!r} is supported, got {value!r}", param="include")
