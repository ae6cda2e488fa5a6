"""A validated request's settings for the engine (`SamplingParams`), checked against the prompt's
length and the model's context, and the settings of each further choice (`n`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from splitserve.api.errors import RequestError
from splitserve.api.request_models import (
    SEED_RANGE,
    CompletionRequest,
    GenerationRequest,
    SLOTargets,
    check_in_vocabulary,
)
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import SamplingParams


def sampling_params(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                    vocab_size: int | None = None,
                    check_constraint: Callable[[OutputConstraint, str], None] | None = None,
                    thinking: str = "") -> SamplingParams:
    """The engine's settings for `request`, whose prompt is `num_prompt_tokens` long (and whose
    logit_bias and allowed_token_ids must name ids under `vocab_size`, where given).
    `check_constraint(constraint, field)` refuses a structured-output constraint that does not
    compile (the ingress's grammar); `thinking`: the free thinking a constraint lets the model write
    first (OutputConstraint's)."""
    max_tokens = _max_tokens(request, num_prompt_tokens, max_model_len)
    check_in_vocabulary(request.logit_bias or {}, vocab_size, "logit_bias")
    check_in_vocabulary(request.allowed_token_ids or (), vocab_size, "allowed_token_ids")
    constraint, constraint_field = request.output_constraint()
    if constraint is not None and (request.ignore_eos or request.min_tokens):
        raise RequestError(f"{constraint_field}: structured output ends with EOS once the output matches; it "
                           "cannot be combined with ignore_eos or min_tokens", param=constraint_field)
    if constraint is not None and thinking:
        constraint = dataclasses.replace(constraint, thinking=thinking)
    if constraint is not None and check_constraint is not None:
        check_constraint(constraint, constraint_field)
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=request.min_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=request.top_k, top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens, min_p=request.min_p, logprobs=_computed_logprobs(request),
            prompt_logprobs=request.requested_prompt_logprobs(), constraint=constraint,
            presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=request.repetition_penalty, logit_bias=request.logit_bias or {},
            allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words or (),
            cache_salt=request.cache_salt, priority=request.priority,
            **_slo_seconds(request.slo))
    except ValueError as exc:
        raise _sampling_error(str(exc)) from None


def _computed_logprobs(request: GenerationRequest) -> int | None:
    """What the workers compute: the client's logprobs, and at least the sampled token's when
    best_of ranks choices by them."""
    asked = request.requested_logprobs()
    runs, returned = request.num_choices()
    return (asked or 0) if runs > returned else asked


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s settings (n > 1): its own seed stream, seed + index, when a seed is given."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed if seed <= SEED_RANGE[1] else params.seed - index)


def _slo_seconds(slo: SLOTargets | None) -> dict:
    if slo is None:
        return {}
    return {"ttft_slo_s": None if slo.ttft_ms is None else slo.ttft_ms / 1000,
            "tbt_slo_s": None if slo.tbt_ms is None else slo.tbt_ms / 1000}


def _max_tokens(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The completion limit: the requested one, checked against the context, or what is left of it."""
    what = request.PROMPT_FIELD
    context = f"This model's maximum context length is {max_model_len} tokens."
    if num_prompt_tokens >= max_model_len:
        raise RequestError(f"{context} However, your prompt has {num_prompt_tokens} tokens, which leaves no room "
                           f"for the completion. Please reduce the length of the {what}.",
                           param=what, code="context_length_exceeded")
    max_tokens, field = request.requested_max_tokens()
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if request.scores_prompt_only():
        return 1  # the prefill must run (it computes the prompt's logprobs); its one token is not returned
    if max_tokens < 1:
        zero = " (0 only with echo, to score the prompt)" if isinstance(request, CompletionRequest) else ""
        raise RequestError(f"{field} must be at least 1{zero}, got {max_tokens}", param=field)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(f"{context} However, you requested {num_prompt_tokens + max_tokens} tokens "
                           f"({num_prompt_tokens} in the {what}, {max_tokens} in the completion). "
                           f"Please reduce the length of the {what} or {field}.",
                           param=field, code="context_length_exceeded")
    return max_tokens


def _sampling_error(message: str) -> RequestError:
    """SamplingParams' messages start with the field's name ("top_p must be ...", "stop strings ...")."""
    first_word = message.split(" ", 1)[0]
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return RequestError(message, param=first_word if first_word in fields else None)
