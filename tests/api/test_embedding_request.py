"""OpenAI's embeddings request taken as `/v1/embeddings` takes it (its inputs tokenized, bounded,
checked against the context, the model named), and the body it answers: floats, or base64 of
little-endian float32 that numpy reads back (as the `openai` client does), `dimensions` truncated
and normalized again."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from splitserve.api.embedding_request import embeddings_body, prepare_embeddings
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import ServedModels
from splitserve.engine.demo import demo_tokenizer

TOKENIZER = demo_tokenizer()
SERVED = ServedModels(("demo",), ("sql",))


def prepare(limits: RequestLimits = RequestLimits(), max_model_len: int = 64, hidden_size: int = 8, **body):
    return prepare_embeddings(json.dumps({"model": "demo", **body}).encode(), TOKENIZER, SERVED, max_model_len,
                              limits, hidden_size)


def test_each_input_is_a_prompt_only_request_asking_its_embedding():
    prepared = prepare(input=["ab", [7, 8, 9]])
    assert prepared.prompts == [TOKENIZER.encode("ab"), [7, 8, 9]]
    assert [(p.embed, p.max_tokens, p.lora) for p in prepared.params] == [(True, 1, None)] * 2
    assert prepare(input="ab").prompts == [TOKENIZER.encode("ab")] and prepare(input=[5, 6]).prompts == [[5, 6]]
    assert prepare(model="sql", input="ab").params[0].lora == "sql"  # an adapter's embeddings


@pytest.mark.parametrize("body, param, status", [
    ({"input": []}, "input", 400), ({"input": ""}, "input", 400), ({"input": [[]]}, "input", 400),
    ({"input": [10 ** 6]}, "input", 400), ({"input": "x" * 70}, "input", 400),
    ({"input": ["a"] * 3, "limits": RequestLimits(max_prompts=2)}, "input", 400),
    ({"input": "abc", "limits": RequestLimits(max_prompt_chars=2)}, "input", 413),
    ({"input": "a", "dimensions": 9}, "dimensions", 400), ({"input": "a", "dimensions": 0}, "dimensions", 400),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": "a", "model": "other"}, "model", 404), ({"input": "a", "temperature": 1}, "temperature", 400),
])
def test_a_bad_request_names_its_field(body, param, status):
    with pytest.raises(RequestError) as refused:
        prepare(**body)
    assert (refused.value.param, refused.value.status) == (param, status)


def test_the_body_holds_each_vector_in_order_with_the_usage():
    prepared = prepare(input=["ab", "cd"])
    vectors = [(0.6, 0.8, 0.0), (0.0, 0.6, 0.8)]
    body = prepared.body(vectors)
    assert body["object"] == "list" and body["model"] == "demo"
    assert [(d["object"], d["index"], d["embedding"]) for d in body["data"]] == [
        ("embedding", 0, [0.6, 0.8, 0.0]), ("embedding", 1, [0.0, 0.6, 0.8])]
    tokens = len(TOKENIZER.encode("ab")) + len(TOKENIZER.encode("cd"))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_base64_is_little_endian_float32_and_dimensions_truncate_then_normalize():
    vector = (0.6, 0.8, 0.0)
    encoded = embeddings_body(prepare(input="a", encoding_format="base64").request, [vector], 1)
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(vector)
    short = embeddings_body(prepare(input="a", dimensions=1).request, [vector], 1)["data"][0]["embedding"]
    assert short == pytest.approx([1.0])  # 0.6 alone, normalized
    assert embeddings_body(prepare(input="a", dimensions=8).request, [vector], 1)["data"][0]["embedding"] == [
        0.6, 0.8, 0.0]
