"""A validated request's engine settings: every field maps onto SamplingParams, the lengths are
checked against the context, each refusal names its field, and each further choice (`n`) gets its
own seed stream."""
import json

import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.request_models import CompletionRequest, parse_request
from splitserve.api.request_sampling import choice_params, sampling_params
from splitserve.engine.sampling_params import SamplingParams
from tests.api.request_helpers import CHAT, COMPLETION, chat, completion, refusal


def test_sampling_params_mapping():
    request = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["x", "yz"], min_tokens=2,
                         ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True, skip_special_tokens=False)
    assert sampling_params(request, 10, 100) == SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_k=5, top_p=0.9, seed=3, stop=("x", "yz"),
        stop_token_ids=(9,), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False)
    nulls = completion(temperature=None, top_p=None, stop="s", max_tokens=None)
    assert sampling_params(nulls, 10, 100) == SamplingParams(max_tokens=90, stop=("s",))


def test_default_max_tokens():
    assert sampling_params(completion(), 10, 100).max_tokens == 16  # OpenAI's completions default
    assert sampling_params(chat(), 10, 100).max_tokens == 90  # the rest of the context
    assert sampling_params(chat(max_completion_tokens=5), 10, 100).max_tokens == 5
    assert sampling_params(chat(max_tokens=6), 10, 100).max_tokens == 6
    assert sampling_params(chat(max_tokens=90), 10, 100).max_tokens == 90


def test_both_length_limits_are_refused():
    error = refusal(ChatCompletionRequest, {**CHAT, "max_tokens": 5, "max_completion_tokens": 5})
    assert error.param == "max_tokens" and "set only one" in error.message


@pytest.mark.parametrize("request_, field", [(completion(max_tokens=0), "max_tokens"),
                                             (chat(max_tokens=-3), "max_tokens"),
                                             (chat(max_completion_tokens=0), "max_completion_tokens")])
def test_max_tokens_at_least_one(request_, field):
    with pytest.raises(RequestError) as info:
        sampling_params(request_, 10, 100)
    value = getattr(request_, field)
    zero = " (0 only with echo, to score the prompt)" if isinstance(request_, CompletionRequest) else ""
    assert (info.value.message, info.value.param) == (f"{field} must be at least 1{zero}, got {value}", field)


def test_echo_asks_the_prefill_for_prompt_logprobs_and_max_tokens_0_scores_the_prompt_alone():
    scoring = completion(echo=True, max_tokens=0, logprobs=1)
    assert scoring.scores_prompt_only()
    params = sampling_params(scoring, 10, 100)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 1, 1)
    assert sampling_params(completion(echo=True), 10, 100).prompt_logprobs is None  # text only
    assert sampling_params(completion(logprobs=2), 10, 100).prompt_logprobs is None  # not echoed
    assert not completion(echo=True, max_tokens=3).scores_prompt_only()


def context_error(request, num_prompt_tokens, max_model_len) -> RequestError:
    with pytest.raises(RequestError) as info:
        sampling_params(request, num_prompt_tokens, max_model_len)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    return info.value


def test_prompt_longer_than_the_context():
    error = context_error(chat(), 100, 100)
    assert error.param == "messages"
    assert error.message == ("This model's maximum context length is 100 tokens. However, your prompt has 100 "
                             "tokens, which leaves no room for the completion. Please reduce the length of the messages.")
    assert context_error(completion(), 150, 100).param == "prompt"


def test_prompt_plus_completion_longer_than_the_context():
    error = context_error(completion(max_tokens=20), 90, 100)
    assert error.param == "max_tokens"
    assert error.message == ("This model's maximum context length is 100 tokens. However, you requested 110 tokens "
                             "(90 in the prompt, 20 in the completion). Please reduce the length of the prompt or "
                             "max_tokens.")
    error = context_error(chat(max_completion_tokens=91), 10, 100)
    assert error.param == "max_completion_tokens" and "(10 in the messages, 91 in the completion)" in error.message


@pytest.mark.parametrize("fields, param, message", [
    ({"temperature": -1}, "temperature", "temperature must be a number in [0, 3.403e+38] (float32's), got -1.0"),
    ({"temperature": 1e39}, "temperature", "temperature must be a number in [0, 3.403e+38] (float32's), got 1e+39"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"top_k": 0}, "top_k", "top_k must be -1 (disabled) or >= 1, got 0"),
    ({"min_tokens": 20}, "min_tokens", "min_tokens must be an integer in [0, max_tokens=16], got 20"),
    ({"stop": ["ok", ""]}, "stop", "stop strings must be non-empty"),
])
def test_sampling_params_errors_name_the_field(fields, param, message):
    with pytest.raises(RequestError) as info:
        sampling_params(completion(**fields), 10, 100)
    assert (info.value.message, info.value.param, info.value.status) == (message, param, 400)


def test_penalties_biases_and_min_p_map_to_the_engine():
    request = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100, "3": 2.5}, min_p=0.1,
                   repetition_penalty=1.2)
    params = sampling_params(request, 10, 100, vocab_size=64)
    assert (params.presence_penalty, params.frequency_penalty, params.min_p, params.repetition_penalty) == \
        (0.5, -1.0, 0.1, 1.2)
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert sampling_params(chat(presence_penalty=None), 10, 100).presence_penalty == 0


def test_allowed_token_ids_and_bad_words_map_to_the_engine():
    params = sampling_params(completion(allowed_token_ids=[9, 3, 9], bad_words=["foo", " bar baz"]), 10, 100, 64)
    assert (params.allowed_token_ids, params.bad_words) == ((3, 9), ("foo", " bar baz"))
    plain = sampling_params(completion(), 10, 100, 64)
    assert (plain.allowed_token_ids, plain.bad_words, plain.cache_salt) == (None, (), None)
    assert sampling_params(chat(cache_salt="tenant-7"), 10, 100).cache_salt == "tenant-7"
    assert sampling_params(chat(priority=-5), 10, 100).priority == -5


@pytest.mark.parametrize("body, message, param", [
    ({"allowed_token_ids": [3, 64]}, "allowed_token_ids: token id 64 is outside the vocabulary (ids 0..63)",
     "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be 1 to 262144 token ids >= 0, got 0 (())",
     "allowed_token_ids"),
    ({"allowed_token_ids": [-2]}, "allowed_token_ids must be 1 to 262144 token ids >= 0, got 1 ((-2,))",
     "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words must be words of 1 to 256 characters, not only spaces, got (' ',)", "bad_words"),
    ({"bad_words": ["w"] * 129}, "bad_words may hold at most 128 words, got 129", "bad_words"),
    ({"priority": 2**31}, "priority must be an integer in [-2147483647, 2147483647], got 2147483648", "priority"),
    ({"cache_salt": ""}, "cache_salt must be a string of 1 to 1024 characters or None, got ''", "cache_salt"),
])
def test_bad_allowed_token_ids_and_bad_words_are_400s_naming_them(body, message, param):
    with pytest.raises(RequestError) as info:
        sampling_params(parse_request(CompletionRequest, json.dumps({**COMPLETION, **body}).encode()), 10, 100, 64)
    assert (info.value.message, info.value.param, info.value.status) == (message, param, 400)


@pytest.mark.parametrize("body, message, param", [
    ({"logit_bias": {"x1": 5}}, "logit_bias: keys must be token ids (decimal strings), got 'x1'", "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1: Input should be a valid number", "logit_bias.1"),
    ({"logit_bias": {"\u0663": 5}}, "logit_bias: keys must be token ids (decimal strings), got '\u0663'", "logit_bias"),
])
def test_malformed_logit_bias_is_refused_naming_it(body, message, param):
    error = refusal(CompletionRequest, {**COMPLETION, **body})
    assert (error.message, error.param, error.status) == (message, param, 400)


@pytest.mark.parametrize("body, message, param", [
    ({"logit_bias": {"64": 1}}, "logit_bias: token id 64 is outside the vocabulary (ids 0..63)", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias maps token ids >= 0 to numbers in [-100, 100], got (5, 101.0)",
     "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5", "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10], got 0.0", "repetition_penalty"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5", "min_p"),
])
def test_out_of_range_penalties_and_biases_are_400s(body, message, param):
    with pytest.raises(RequestError) as info:
        sampling_params(parse_request(CompletionRequest, json.dumps({**COMPLETION, **body}).encode()), 10, 100, 64)
    assert (info.value.message, info.value.param, info.value.status) == (message, param, 400)


def test_logprobs_map_to_the_number_of_top_alternatives():
    assert sampling_params(completion(logprobs=3), 10, 100).logprobs == 3
    assert sampling_params(completion(logprobs=0), 10, 100).logprobs == 0
    assert sampling_params(completion(), 10, 100).logprobs is None
    assert sampling_params(chat(logprobs=True, top_logprobs=2), 10, 100).logprobs == 2
    assert sampling_params(chat(logprobs=True), 10, 100).logprobs == 0
    assert sampling_params(chat(logprobs=False), 10, 100).logprobs is None
    error = refusal(ChatCompletionRequest, {**CHAT, "top_logprobs": 2})
    assert (error.message, error.param) == ("top_logprobs: only allowed when logprobs is true", "top_logprobs")
    error = refusal(CompletionRequest, {**COMPLETION, "logprobs": 21})
    assert error.param == "logprobs" and "less than or equal to 20" in error.message


def test_slo_targets_reach_the_engine_in_seconds():
    assert sampling_params(completion(slo={"ttft_ms": 250, "tbt_ms": 40.5}), 10, 100) == SamplingParams(
        max_tokens=16, ttft_slo_s=0.25, tbt_slo_s=0.0405)
    only_tbt = sampling_params(chat(slo={"tbt_ms": 100}), 10, 100)
    assert (only_tbt.ttft_slo_s, only_tbt.tbt_slo_s) == (None, 0.1)
    assert sampling_params(chat(), 10, 100).tbt_slo_s is None  # the policy's default applies


@pytest.mark.parametrize("slo, param", [({"ttft_ms": 0}, "slo.ttft_ms"), ({"tbt_ms": -5}, "slo.tbt_ms"),
                                        ({"tbt_ms": "fast"}, "slo.tbt_ms"), ({"p99_ms": 5}, "slo.p99_ms")])
def test_bad_slo_targets_are_refused_naming_the_field(slo, param):
    assert refusal(CompletionRequest, {**COMPLETION, "slo": slo}).param == param


def test_n_and_best_of_give_the_choices_and_their_seed_streams():
    assert completion(n=3).num_choices() == (3, 3) and chat(n=2).num_choices() == (2, 2)
    ranked = completion(n=2, best_of=4)
    assert ranked.num_choices() == (4, 2)
    assert sampling_params(ranked, 10, 100).logprobs == 0  # ranking needs the sampled tokens' logprobs
    assert sampling_params(completion(n=2), 10, 100).logprobs is None
    params = sampling_params(completion(seed=7), 10, 100)
    assert [choice_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(sampling_params(completion(), 10, 100), 2).seed is None
    top = sampling_params(completion(seed=2**64 - 1), 10, 100)
    assert choice_params(top, 1).seed == 2**64 - 2


@pytest.mark.parametrize("fields, needle", [({"n": 3, "best_of": 2}, "at least n"),
                                            ({"best_of": 2, "stream": True}, "cannot stream")])
def test_best_of_below_n_or_streamed_is_refused(fields, needle):
    error = refusal(CompletionRequest, {**COMPLETION, **fields})
    assert error.param == "best_of" and needle in error.message
