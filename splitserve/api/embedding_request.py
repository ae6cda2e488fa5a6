"""OpenAI's embeddings (`POST /v1/embeddings`): a request's inputs as token ids, each run as a
prompt-only request asking its embedding (`SamplingParams.embed`: the last token's final hidden
state, L2-normalized), and the response body. `dimensions` keeps a vector's first that many values,
normalized again (Matryoshka embeddings, as OpenAI's text-embedding-3 and Qwen3-Embedding
truncate); `encoding_format: base64` sends each vector as little-endian float32 bytes."""
from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field

from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import ModelNames, check_model, parse_request, prompt_input, token_ids_of
from splitserve.api.strict_model import STRICT
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer


Inputs = Annotated[str | list[int] | list[str | list[int]], BeforeValidator(prompt_input)]  # one or several


def several(inputs: str | list[int] | list[str | list[int]]) -> list[str | list[int]]:
    """Every input of an `Inputs` field: one, or the several of a list, in order."""
    return inputs if isinstance(inputs, list) and not all(isinstance(t, int) for t in inputs) else [inputs]


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: str
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, Field(ge=1)] = None
    user: str | None = None


@dataclass(frozen=True)
class PreparedEmbeddings:
    request: EmbeddingRequest
    prompts: list[list[int]]  # each input's token ids
    params: list[SamplingParams]  # each input's (one request's inputs share them)
    runs_per_prompt = 1  # an input is one engine request, as a prompt's choices are several

    def body(self, vectors: list[tuple[float, ...]]) -> dict:
        """OpenAI's response: an embedding object per input, in order, and the usage."""
        return embeddings_body(self.request, vectors, sum(map(len, self.prompts)))


def prepare_embeddings(raw: bytes, tokenizer: Tokenizer, served: ModelNames, max_model_len: int,
                       limits: RequestLimits, hidden_size: int) -> PreparedEmbeddings:
    """RequestError (a 4xx naming the field) on a bad body, too many or too long inputs, or more
    `dimensions` than the model's hidden size."""
    body = parse_request(EmbeddingRequest, raw)
    lora = check_model(body.model, served)
    if body.dimensions is not None and body.dimensions > hidden_size:
        raise RequestError(f"dimensions: this model's embeddings have {hidden_size}, got {body.dimensions}",
                           param="dimensions")
    prompts = embedded_prompts(several(body.input), "input", tokenizer, max_model_len, limits)
    return PreparedEmbeddings(body, prompts, [SamplingParams.embedding(lora)] * len(prompts))


def embedded_prompts(texts: list[str | list[int]], field: str, tokenizer: Tokenizer, max_model_len: int,
                     limits: RequestLimits, max_tokens: int | None = None, add_special_tokens: bool = True
                     ) -> list[list[int]]:
    """The token ids of texts to embed (each cut to its first `max_tokens`, if given); a 4xx naming
    `field` for too many, an empty string (OpenAI's rule: nothing has no embedding), an id past the
    vocabulary, or one that does not fit the context."""
    limits.check_prompts(texts, field)
    if "" in texts:
        raise RequestError(f"{field}: an input is an empty string", param=field)
    prompts = [token_ids_of(text, tokenizer, field, add_special_tokens)[:max_tokens] for text in texts]
    check_context(max(len(prompt) for prompt in prompts), max_model_len, field)
    return prompts


def check_context(longest: int, max_model_len: int, field: str) -> None:
    """A 400 naming `field` when a prompt of `longest` tokens leaves no room for its prefill's token."""
    if longest >= max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, an input has "
                           f"{longest} tokens. Please reduce the length of the input.", param=field,
                           code="context_length_exceeded")


def embeddings_body(request: EmbeddingRequest, vectors: list[tuple[float, ...]], prompt_tokens: int) -> dict:
    """OpenAI's response: a list of embedding objects, in the inputs' order, and the usage."""
    data = [{"object": "embedding", "index": index, "embedding": _encoded(_truncated(vector, request.dimensions),
                                                                       request.encoding_format)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _truncated(vector: tuple[float, ...], dimensions: int | None) -> tuple[float, ...]:
    if dimensions is None or dimensions >= len(vector):
        return vector
    kept = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in kept)) or 1.0
    return tuple(x / norm for x in kept)


def _encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
