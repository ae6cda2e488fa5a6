"""RequestLimits: each bound refuses one past it, naming the field, 413 for sizes and 400 for counts."""
import pytest

from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import CompletionRequest

LIMITS = RequestLimits(max_prompt_chars=10, max_stop_strings=2, max_stop_string_chars=3, max_stop_token_ids=2,
                       max_chat_messages=2, max_prompts=2)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "demo", "prompt": "hi", **fields})


def chat(messages) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": messages})


@pytest.mark.parametrize("request_, param, status", [
    (completion(prompt="x" * 11), "prompt", 413),
    (completion(prompt=["x" * 6, "y" * 5]), "prompt", 413),
    (completion(prompt=["a", [5], "b"]), "prompt", 400),
    (completion(stop=["a", "b", "c"]), "stop", 400),
    (completion(stop="abcd"), "stop", 400),
    (completion(stop_token_ids=[1, 2, 3]), "stop_token_ids", 400),
    (chat([{"role": "user", "content": "a"}] * 3), "messages", 400),
    (chat([{"role": "user", "content": [{"type": "text", "text": "x" * 6}] * 2}]), "messages", 413),
])
def test_one_past_a_bound_is_refused_naming_the_field(request_, param, status):
    with pytest.raises(RequestError) as refused:
        LIMITS.check(request_)
    assert (refused.value.param, refused.value.status) == (param, status)
    assert "limit" in refused.value.message


def test_at_the_bounds_passes():
    LIMITS.check(completion(prompt="x" * 10, stop=["abc", "d"], stop_token_ids=[1, 2]))
    LIMITS.check(completion(prompt=list(range(100))))  # token ids are bounded by the context, not by characters
    LIMITS.check(completion(prompt=["x" * 5, "y" * 5]))
    LIMITS.check(completion(prompt=["x" * 10, [1, 2, 3]]))
    LIMITS.check(chat([{"role": "user", "content": "x" * 5}, {"role": "assistant", "content": None}]))


def test_a_priority_is_refused_unless_the_engines_schedule_by_priority():
    with pytest.raises(RequestError) as refused:
        LIMITS.check(completion(priority=-1))
    assert (refused.value.param, refused.value.status) == ("priority", 400)
    assert "first come, first served" in refused.value.message
    LIMITS.check(completion(priority=0))
    RequestLimits(priorities=True).check(completion(priority=-1))
