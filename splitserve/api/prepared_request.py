"""A generation body taken as its endpoint takes it, by the ingress and by batch lines alike: parsed
and validated, the model name and the bounds checked, every prompt tokenized (a chat's through its
template; completions may send several) with its own sampling settings. A `/v1/responses` body is
prepared as the chat completion it asks for (`responses_request`)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.chat_template import chat_prompt_token_ids
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import (
    CompletionRequest,
    GenerationRequest,
    ModelNames,
    check_model,
    parse_request,
    prompt_token_ids_of,
)
from splitserve.api.reasoning import GPT_OSS, constraint_thinking
from splitserve.api.request_sampling import sampling_params
from splitserve.api.responses_request import ResponsesRequest, as_responses_error
from splitserve.api.tool_calls import SPECIAL_TAGGED
from splitserve.engine.output_constraint import HARMONY, OutputConstraint
from splitserve.engine.sampling_params import SamplingParams

ConstraintCheck = Callable[[OutputConstraint, str], None]  # LazyGrammar.check


@dataclass(frozen=True)
class PreparedRequest:
    request: GenerationRequest  # the body, validated
    prompts: list[list[int]]  # each prompt's token ids, in the request's order
    params: list[SamplingParams]  # each prompt's settings (its max_tokens default depends on its length)
    responses: ResponsesRequest | None = None  # the Responses request `request` is the chat of, if any

    @property
    def runs_per_prompt(self) -> int:
        """Engine requests each prompt takes: its computed choices (`n`, `best_of`)."""
        return self.request.num_choices()[0]


def prepare_request(kind: str, raw: bytes, tokenizer, model: ModelNames, max_model_len: int,
                    limits: RequestLimits, check_constraint: ConstraintCheck | None = None,
                    parsers: ChatParsers = ChatParsers()) -> PreparedRequest:
    """`kind`: "completion", "chat" or "responses"; RequestError (a 4xx naming the field) on a bad body.
    `model`: the names served (`ServedModels`: a LoRA adapter's runs the request under it).
    `check_constraint` compiles a structured-output constraint, so one that does not is a 400 now.
    With a reasoning parser, a chat's constraint holds its answer, after a free thinking (GPT-OSS's:
    after its analysis messages, in its final one); with the mistral tool-call parser, a chat offering tools keeps special
    tokens in its text (vLLM's rule: `[TOOL_CALLS]` is one), and with GPT-OSS's reasoning parser
    every chat does (its channels are special tokens)."""
    if kind == "responses":  # a batch line's: no stored responses to continue, none kept in the background
        ask = parse_request(ResponsesRequest, raw)
        for param in ("previous_response_id", "conversation", "background"):
            if getattr(ask, param):
                raise RequestError(f"{param}: a batch line keeps no responses; send the conversation in input",
                                   param=param)
        return prepare_responses(ask, tokenizer, model, max_model_len, limits, check_constraint, parsers)
    body = parse_request(CompletionRequest if kind == "completion" else ChatCompletionRequest, raw)
    lora = check_model(body.model, model)
    limits.check(body)
    prompts = prompt_token_ids_of(body, tokenizer) if kind == "completion" else [chat_prompt_token_ids(body, tokenizer)]
    if body.truncate_prompt_tokens is not None:
        kept = _kept_tokens(body.truncate_prompt_tokens, max_model_len)
        prompts = [prompt[-kept:] for prompt in prompts]
    harmony = kind == "chat" and parsers.reasoning == GPT_OSS
    thinks = kind == "chat" and parsers.reasoning is not None and not harmony
    params = [sampling_params(body, len(prompt), max_model_len, tokenizer.vocab_size, check_constraint,
                              HARMONY if harmony else constraint_thinking(prompt, tokenizer) if thinks else "")
              for prompt in prompts]
    if harmony or (kind == "chat" and parsers.tool_calls in SPECIAL_TAGGED and body.tool_functions()):
        params = [replace(p, skip_special_tokens=False) for p in params]
    if lora is not None:
        params = [replace(p, lora=lora) for p in params]
    if kind == "chat" and body.prediction is not None:
        predicted = _prediction_ids(body.prediction.text, tokenizer, max_model_len)
        params = [replace(p, prediction=predicted) for p in params]
    return PreparedRequest(body, prompts, params)


def prepare_responses(ask: ResponsesRequest, tokenizer, model: ModelNames, max_model_len: int,
                      limits: RequestLimits, check_constraint: ConstraintCheck | None = None,
                      parsers: ChatParsers = ChatParsers()) -> PreparedRequest:
    """A Responses request as the chat completion it asks for; a refusal names the Responses field.
    Its output text's logprobs are chat's, every token's: refused where tokens may be a reasoning
    parser's thinking or a tool call's."""
    if ask.wants_logprobs() and (parsers.reasoning is not None or (ask.tools and ask.tool_choice != "none")):
        raise RequestError("include: the output text's logprobs are not served with a reasoning parser or tools "
                           "(chat's logprobs cover the thinking and the calls too)", param="include")
    def prepare(request: ResponsesRequest) -> PreparedRequest:
        chat = json.dumps(request.to_chat()).encode()
        return prepare_request("chat", chat, tokenizer, model, max_model_len, limits, check_constraint, parsers)

    try:
        prepared = prepare(ask)
    except RequestError as error:
        if ask.truncation != "auto" or not _too_long(error):
            raise as_responses_error(error) from None
        prepared = _truncated(ask, prepare, error)
    return replace(prepared, responses=ask)


def _too_long(refusal: RequestError) -> bool:
    """A refusal that dropping the first items may lift: past the context length, or past the
    bounds on a chat's messages (their count, their characters)."""
    return refusal.code == "context_length_exceeded" or refusal.param == "messages"


def _truncated(ask: ResponsesRequest, prepare: Callable[[ResponsesRequest], PreparedRequest],
               refusal: RequestError) -> PreparedRequest:
    """`truncation: "auto"` (OpenAI's): the first items dropped, the fewest whole turns that make
    the request fit, found by a binary search over where turns start; `refusal` when even its last
    turn does not fit. Its instructions are kept."""
    starts, fits = ask.turn_starts(), None
    low, high = 0, len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        try:
            fits = prepare(ask.without_first(starts[middle]))
            high = middle - 1
        except RequestError as error:
            if not _too_long(error):
                raise as_responses_error(error) from None
            low = middle + 1
    if fits is None:
        raise as_responses_error(refusal) from None
    return fits


def _prediction_ids(text: str, tokenizer, max_model_len: int) -> tuple[int, ...]:
    """A chat's prediction as the answer's tokens (no special tokens), at most a context's worth."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_model_len:
        raise RequestError(f"prediction: {len(ids)} tokens, more than the model's context length, {max_model_len} "
                           "tokens", param="prediction")
    return tuple(ids)


def _kept_tokens(truncate: int, max_model_len: int) -> int:
    """vLLM's truncate_prompt_tokens: the last k tokens of each prompt (-1: as many as the context holds)."""
    if truncate > max_model_len:
        raise RequestError(f"truncate_prompt_tokens: {truncate} is more than the model's context length, "
                           f"{max_model_len} tokens", param="truncate_prompt_tokens")
    return max_model_len if truncate == -1 else truncate
