"""What a choice's text starts with (echo) and which choices best_of keeps, per prompt."""
from __future__ import annotations

import json

from splitserve.api.choice_text import best_choices, choice_options
from splitserve.api.request_models import CompletionRequest, parse_request
from splitserve.engine.demo import demo_tokenizer

TOKENIZER = demo_tokenizer()


def request(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": "demo", **fields}).encode())


def test_echo_is_the_prompt_as_sent_or_the_tokens_the_model_saw():
    sent = request(prompt=["first", [256, 104, 105]], echo=True, max_tokens=1)
    assert choice_options(sent, 0, TOKENIZER.encode("first"), TOKENIZER)["echo"] == "first"
    assert choice_options(sent, 1, [256, 104, 105], TOKENIZER)["echo"] == "<s>hi"
    truncated = request(prompt="a long prompt", echo=True, max_tokens=1, truncate_prompt_tokens=6)
    assert choice_options(truncated, 0, list(b"prompt"), TOKENIZER)["echo"] == "prompt"
    assert choice_options(request(prompt="x"), 0, [1], TOKENIZER)["echo"] is None


def test_best_of_keeps_the_likeliest_numbered_from_the_prompts_first_index():
    choices = [{"index": i, "text": t} for i, t in enumerate("abc")]
    kept = best_choices(choices, [-3.0, -1.0, -2.0], 2, first_index=4)
    assert kept == [{"index": 4, "text": "b"}, {"index": 5, "text": "c"}]
    assert best_choices(choices, [0.0] * 3, 3) is choices  # all returned: as they are
