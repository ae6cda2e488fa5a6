"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt or chat messages to token ids),
`POST /detokenize` (token ids to text) and `GET /tokenizer_info` (the special tokens and the chat
template). Clients that count or score tokens themselves use them instead of downloading the
tokenizer (lm-evaluation-harness's remote tokenizer does)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from splitserve.api.chat_request import ChatCompletionRequest, ChatMessage
from splitserve.api.chat_template import DEFAULT_CHAT_TEMPLATE, chat_prompt_token_ids
from splitserve.api.errors import RequestError
from splitserve.api.request_models import check_in_vocabulary, check_model
from splitserve.api.strict_model import STRICT
from splitserve.engine.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (rendered by the chat template), not both.
    `add_special_tokens`: a prompt's default true; messages' unset gives the chat endpoint's tokens
    (BOS where the template does not write it), true or false as vLLM (on top of the template's
    text, or none)."""
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(request: TokenizeRequest, tokenizer: Tokenizer, served: tuple[str, ...], max_model_len: int) -> dict:
    if request.model is not None:
        check_model(request.model, served)
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("send exactly one of prompt and messages", param="prompt")
    if request.prompt is not None:
        ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
    else:
        chat = ChatCompletionRequest(model=served[0], messages=request.messages,
                                     add_generation_prompt=request.add_generation_prompt,
                                     continue_final_message=request.continue_final_message)
        ids = chat_prompt_token_ids(chat, tokenizer, request.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(request: DetokenizeRequest, tokenizer: Tokenizer, served: tuple[str, ...]) -> dict:
    if request.model is not None:
        check_model(request.model, served)
    check_in_vocabulary(request.tokens, tokenizer.vocab_size, "tokens")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict:
    def spelled(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len,
            "bos_token": spelled(tokenizer.bos_token_id), "eos_token": spelled(next(iter(tokenizer.eos_token_ids), None)),
            "chat_template": tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE}
