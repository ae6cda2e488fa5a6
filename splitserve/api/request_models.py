"""OpenAI's `/v1/completions` request and the fields chat's shares with it (`GenerationRequest`;
chat's own in `chat_request`): pydantic models and their validation (their structured-output fields
in `output_format`, their engine settings in `request_sampling`), and parsing a body into one.

Every refusal is a `RequestError` whose message names the field, so a client sees what to change.
Unknown fields are refused rather than ignored: a silently ignored sampling parameter would change
what the client gets without telling it. Parameters this server does not implement are accepted only
with the values that change nothing (`suffix` null).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, ValidationError, model_validator

from splitserve.api import client_json
from splitserve.api.errors import RequestError
from splitserve.api.output_format import StructuredOutputFields
from splitserve.api.strict_model import STRICT
from splitserve.engine.sampling_params import MAX_LOGPROBS
from splitserve.engine.tokenizer import Tokenizer

# torch.Generator.manual_seed takes any value of int64 or uint64; a larger seed would fail in a worker.
SEED_RANGE = (-(2**63), 2**64 - 1)


def only_values(*allowed, reason: str) -> AfterValidator:
    """A validator refusing every value but `allowed` (the values that change nothing)."""
    def check(value):
        if value not in allowed:
            raise ValueError(f"{reason}, got {value!r}")
        return value
    return AfterValidator(check)


def prompt_input(value):
    """One prompt (a string or a non-empty list of token ids) or a list of two or more; a list
    holding one prompt is that prompt."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        prompts = [_one_prompt(p, f"prompt {i}: ") for i, p in enumerate(value)]
        return prompts[0] if len(prompts) == 1 else prompts
    return _one_prompt(value)


def _one_prompt(value, where: str = ""):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        return value
    raise ValueError(f"{where}must be a string or a non-empty list of token ids (integers >= 0)")


def _stop_strings(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string, a list of strings, or null")


def _token_biases(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: JSON object keys are token ids written as decimal strings."""
    biases = {}
    for key, bias in (value or {}).items():
        if not (key.isascii() and key.isdecimal()):
            raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
        biases[int(key)] = bias
    return biases


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
        raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata)]


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


NOT_SUPPORTED = "is not supported"
MAX_CHOICES = 16  # n and best_of: each choice is a decode of its own
Stop = Annotated[str | list[str] | None, BeforeValidator(_stop_strings)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk (benchmarks time tokens by it)


class SLOTargets(BaseModel):
    """splitserve's extension: the request's latency targets, which the SLO-aware (accelgen)
    scheduling policies order and size batches by; other policies ignore them."""
    model_config = STRICT
    ttft_ms: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    tbt_ms: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None


class GenerationRequest(StructuredOutputFields):
    """The fields both endpoints share: the model, sampling, stopping, streaming and structured output."""
    model_config = STRICT
    PROMPT_FIELD: ClassVar[str]

    model: str
    max_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int | None, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] = None
    user: str | None = None  # accepted and ignored, as an end-user id for abuse monitoring
    # accepted and ignored, as they ask nothing of the output: this server keeps no completions
    # (store, and metadata to find them by) and has one service tier
    store: bool | None = None
    metadata: Metadata = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    presence_penalty: float | None = 0
    frequency_penalty: float | None = 0
    logit_bias: Annotated[dict[str, float] | None, AfterValidator(_token_biases)] = None
    # Extensions (vLLM's names).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # words the output may not contain (engine/bad_words.py)
    cache_salt: str | None = None  # prefix-cache blocks are shared only with requests of the same salt
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"
    priority: int = 0  # with engine.scheduling_policy priority: a lower value is served first
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    slo: SLOTargets | None = None  # splitserve's extension (see SLOTargets)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the model's context

    @model_validator(mode="after")
    def _truncation_keeps_something(self):
        if self.truncate_prompt_tokens not in (None, -1) and self.truncate_prompt_tokens < 1:
            raise RequestError(f"truncate_prompt_tokens: the number of prompt tokens to keep, at least 1 (or -1: "
                               f"the model's context), got {self.truncate_prompt_tokens}", param="truncate_prompt_tokens")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true", param="stream_options")
        return self

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion-length limit the client asked for, and the field it came in."""
        return self.max_tokens, "max_tokens"

    def echoes_prompt(self) -> bool:
        """The response starts with the prompt (completions' `echo`)."""
        return False

    def tool_functions(self) -> list[dict]:
        """The functions offered to the model (chat's `tools`)."""
        return []

    def callable_functions(self) -> list[dict]:
        """The functions the model may call."""
        return []

    def num_choices(self) -> tuple[int, int]:
        """(choices computed, choices returned): n, or completions' best_of and n."""
        return self.n or 1, self.n or 1

    def requested_prompt_logprobs(self) -> int | None:
        """How many top alternatives per prompt token the client wants logprobs of; None: none."""
        return None

    def scores_prompt_only(self) -> bool:
        """Echo with max_tokens 0: the prompt and its logprobs, nothing generated (how evaluation
        harnesses score a text)."""
        return self.echoes_prompt() and self.requested_max_tokens()[0] == 0


class CompletionRequest(GenerationRequest):
    PROMPT_FIELD: ClassVar[str] = "prompt"

    prompt: Annotated[str | list[int] | list[str | list[int]], BeforeValidator(prompt_input)]
    max_tokens: int | None = 16
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None  # the top alternatives per token
    echo: bool | None = False  # the prompt in front of the text, with its logprobs when those are asked for
    best_of: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = None  # choices computed; the n likeliest return
    suffix: Annotated[str | None, only_values(None, reason=NOT_SUPPORTED)] = None

    def requested_logprobs(self) -> int | None:
        """How many top alternatives per token the client wants logprobs of; None: no logprobs."""
        return self.logprobs

    def echoes_prompt(self) -> bool:
        return bool(self.echo)

    @model_validator(mode="after")
    def _best_of_covers_n(self):
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise RequestError(f"best_of must be at least n ({self.n}), got {self.best_of}", param="best_of")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise RequestError("best_of: cannot stream when best_of > n (the best are known at the end)",
                               param="best_of")
        return self

    def num_choices(self) -> tuple[int, int]:
        return self.best_of or self.n or 1, self.n or 1

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """Every prompt: one, or the several of a list (each answered with its own choices)."""
        several = isinstance(self.prompt, list) and not all(isinstance(t, int) for t in self.prompt)
        return self.prompt if several else [self.prompt]


def parse_request(model_cls: type[BaseModel], raw: bytes) -> BaseModel:
    """`raw` (an HTTP body) validated as `model_cls`; any problem is a `RequestError`."""
    try:
        body = client_json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise _request_error(exc.errors(include_url=False)) from None


def _request_error(errors: list[dict]) -> RequestError:
    """The first field's pydantic error as a `RequestError` naming its path (`messages.0.content`).
    A union field fails in each of its branches (`tool_choice`: a string, or one of two objects):
    the error that reached deepest into the body is the branch the client meant."""
    field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    error, path = max(((e, _body_path(e["loc"])) for e in field), key=lambda found: len(found[1]))
    path = ".".join(str(part) for part in path)
    if error["type"] == "extra_forbidden":
        return RequestError(f"{path}: unsupported parameter", param=path)
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return RequestError(f"{path}: {message}", param=path)


def _body_path(loc: tuple) -> tuple:
    """`loc` without pydantic's union branch tags (`literal['none','auto']`, a model's class name);
    a dict's keys (`logit_bias.1`) stay."""
    return tuple(p for p in loc if not isinstance(p, str) or not ("[" in p or p.isidentifier() and p[0].isupper()))


@dataclass(frozen=True)
class ServedModels:
    """What clients may send as `model`: the base model's names (aliases; the first names the
    metrics) and each LoRA adapter's, which runs the base model with that adapter."""

    names: tuple[str, ...]
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        clash = set(self.names) & set(self.adapters)
        if clash:
            raise ValueError(f"adapter names must differ from the model's, got {sorted(clash)}")

    @property
    def all(self) -> tuple[str, ...]:
        return self.names + self.adapters

    @classmethod
    def of(cls, served: "ModelNames") -> "ServedModels":
        if isinstance(served, ServedModels):
            return served
        return cls((served,) if isinstance(served, str) else tuple(served))


ModelNames = str | tuple[str, ...] | ServedModels  # what a server answers to: one name, aliases, or those and adapters


def check_model(requested: str, served: ModelNames) -> str | None:
    """`served`: the name, or every alias, this server answers to, or those and its adapters'.
    Returns the LoRA adapter `requested` names (None: the base model)."""
    served = ServedModels.of(served)
    if requested not in served.all:
        listed = ", ".join(f"`{n}`" for n in served.all)
        raise RequestError(f"The model `{requested}` does not exist. This server serves {listed}.",
                           status=404, param="model", code="model_not_found")
    return requested if requested in served.adapters else None


def prompt_token_ids_of(request: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Each prompt's token ids: a string is encoded (with the tokenizer's special tokens), a token
    list is checked against the vocabulary and used as is."""
    return [token_ids_of(prompt, tokenizer) for prompt in request.prompts()]


def token_ids_of(prompt: str | list[int], tokenizer: Tokenizer, field: str = "prompt",
                 add_special_tokens: bool = True) -> list[int]:
    """One prompt's token ids (a text's with the tokenizer's special tokens, unless not
    `add_special_tokens`); a 400 naming `field` for an empty one or an id past the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise RequestError(f"{field}: the {field} is empty; send at least one token", param=field)
        return ids
    check_in_vocabulary(prompt, tokenizer.vocab_size, field)
    return list(prompt)


def check_in_vocabulary(token_ids, vocab_size: int | None, field: str) -> None:
    """A 400 naming `field` if a token id is not under `vocab_size` (None: nothing to check)."""
    bad = next((t for t in token_ids if vocab_size is not None and t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"{field}: token id {bad} is outside the vocabulary (ids 0..{vocab_size - 1})", param=field)
