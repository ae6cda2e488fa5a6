"""vLLM's tokenizer endpoints as pure functions: ids, text and the special tokens a client needs
to score text itself (lm-evaluation-harness's remote tokenizer reads `eos_token`, `/tokenize` ids
and `/detokenize` text)."""
from __future__ import annotations

import json

import pytest

from splitserve.api.errors import RequestError
from splitserve.api.request_models import parse_request
from splitserve.api.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from splitserve.engine.demo import demo_tokenizer

SERVED = ("demo", "alias")


def body(model_cls, **fields):
    return parse_request(model_cls, json.dumps(fields).encode())


def test_tokenize_a_prompt_with_or_without_special_tokens_and_back():
    tok = demo_tokenizer()
    with_bos = tokenize(body(TokenizeRequest, prompt="héllo"), tok, SERVED, 2048)
    bare = tokenize(body(TokenizeRequest, prompt="héllo", add_special_tokens=False, model="alias"), tok, SERVED, 2048)
    assert with_bos == {"count": 7, "max_model_len": 2048, "tokens": [tok.BOS, *"héllo".encode()]}
    assert bare["tokens"] == with_bos["tokens"][1:]
    assert detokenize(body(DetokenizeRequest, tokens=with_bos["tokens"]), tok, SERVED) == {"prompt": "<s>héllo"}


def test_tokenize_chat_messages_through_the_chat_template():
    tokens = tokenize(body(TokenizeRequest, messages=[{"role": "user", "content": "hi"}]), demo_tokenizer(), SERVED,
                      2048)["tokens"]
    assert bytes(tokens[1:]).decode() == "user: hi\nassistant:"
    prefilled = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Yes: "}]
    tokens = tokenize(body(TokenizeRequest, messages=prefilled, add_generation_prompt=False,
                           continue_final_message=True), demo_tokenizer(), SERVED, 2048)["tokens"]
    assert bytes(tokens[1:]).decode() == "user: hi\nassistant: Yes: "


def test_chat_messages_special_tokens_as_asked(tmp_path):
    """Unset: the chat endpoint's tokens, one BOS whether the template writes it or not; true: the
    tokenizer's on top of the template's text, false: none (vLLM's), as transformers encodes that text."""
    from transformers import AutoTokenizer

    from splitserve.engine.tokenizer import load_tokenizer
    from tests.api.test_chat_template import save_checkpoint

    path = save_checkpoint(tmp_path, "llama3")  # its template writes BOS, its tokenizer adds BOS too
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hello there"}]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(theirs.bos_token)
    for asked, want in ((None, theirs.encode(text, add_special_tokens=False)),
                        (True, theirs.encode(text, add_special_tokens=True)),
                        (False, theirs.encode(text, add_special_tokens=False))):
        fields = {"messages": messages} if asked is None else {"messages": messages, "add_special_tokens": asked}
        assert tokenize(body(TokenizeRequest, **fields), ours, SERVED, 2048)["tokens"] == want, asked


@pytest.mark.parametrize("model_cls, fields, param", [
    (TokenizeRequest, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    (TokenizeRequest, {}, "prompt"),
    (TokenizeRequest, {"prompt": "a", "model": "other"}, "model"),
    (TokenizeRequest, {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     "continue_final_message"),
    (DetokenizeRequest, {"tokens": [1, 259]}, "tokens"),
])
def test_bad_bodies_are_refused_naming_the_field(model_cls, fields, param):
    answer = tokenize if model_cls is TokenizeRequest else lambda b, t, s, _: detokenize(b, t, s)
    with pytest.raises(RequestError) as refused:
        answer(body(model_cls, **fields), demo_tokenizer(), SERVED, 2048)
    assert (refused.value.status, refused.value.param) == (404 if param == "model" else 400, param)


def test_negative_token_ids_fail_validation():
    with pytest.raises(RequestError) as refused:
        body(DetokenizeRequest, tokens=[-1])
    assert refused.value.param == "tokens.0"


def test_tokenizer_info_names_the_special_tokens_and_the_template():
    info = tokenizer_info(demo_tokenizer(), 2048)
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", 2048)
    assert "add_generation_prompt" in info["chat_template"]
