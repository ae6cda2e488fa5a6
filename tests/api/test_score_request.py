"""`/score` and `/rerank` bodies taken as vLLM takes them (pairs one to one, one to many, many to
many; a query against documents), each distinct text embedded once, and the bodies they answer:
cosine similarities (numpy's), rerank results best first in the shape Cohere's client parses; with a
reranker's label tokens, each pair one prompt scored by the labels' softmax (numpy's)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from cohere import RerankResponse
from cohere.v2 import V2RerankResponse

from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import ServedModels
from splitserve.api.score_request import label_token_ids, prepare_rerank, prepare_score
from splitserve.engine.demo import demo_tokenizer

TOKENIZER = demo_tokenizer()
SERVED = ServedModels(("demo",), ("sql",))


def score(limits: RequestLimits = RequestLimits(), max_model_len: int = 64, labels: tuple[int, ...] = (), **body):
    return prepare_score(json.dumps({"model": "demo", **body}).encode(), TOKENIZER, SERVED, max_model_len, limits,
                         labels)


def rerank(limits: RequestLimits = RequestLimits(), max_model_len: int = 64, labels: tuple[int, ...] = (), **body):
    return prepare_rerank(json.dumps({"model": "demo", **body}).encode(), TOKENIZER, SERVED, max_model_len, limits,
                          labels)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def vectors(count: int, seed: int = 0) -> list[tuple[float, ...]]:
    return [tuple(v) for v in np.random.default_rng(seed).normal(size=(count, 6)).tolist()]


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("text_1, text_2, prompts, pairs", [
    ("q", "a", ["q", "a"], [(0, 1)]),
    ("q", ["a", "b", "a"], ["q", "a", "b"], [(0, 1), (0, 2), (0, 1)]),  # the query and a repeated text once
    (["q", "r"], ["a", "q"], ["q", "a", "r"], [(0, 1), (2, 0)]),
    (["q"], ["a", "b"], ["q", "a", "b"], [(0, 1), (0, 2)]),  # a list of one is one text
])
def test_pairs_embed_each_distinct_text_once(text_1, text_2, prompts, pairs):
    prepared = score(text_1=text_1, text_2=text_2)
    assert prepared.prompts == [ids(t) for t in prompts] and prepared.pairs == pairs
    assert all(p.embed for p in prepared.params) and len(prepared.params) == len(prompts)
    assert score(model="sql", text_1="q", text_2="a").params[0].lora == "sql"


def test_a_score_is_the_cosine_similarity_of_the_two_embeddings():
    prepared = score(text_1="q", text_2=["a", "b"])
    vs = vectors(3)
    body = prepared.body(vs)
    assert body["object"] == "list" and body["model"] == "demo" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert [d["score"] for d in body["data"]] == pytest.approx([cosine(vs[0], vs[1]), cosine(vs[0], vs[2])])
    tokens = len(ids("q")) + len(ids("a")) + len(ids("b"))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_ranks_the_documents_best_first_in_cohere_s_shape():
    documents = ["a", {"text": "bb"}, "ccc", "dd"]
    prepared = rerank(query="q", documents=documents, top_n=3)
    assert prepared.prompts == [ids(t) for t in ("q", "a", "bb", "ccc", "dd")]
    vs = vectors(5, seed=1)
    expected = [cosine(vs[0], v) for v in vs[1:]]
    body = prepared.body(vs)
    order = sorted(range(4), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in order])
    assert [r["document"]["text"] for r in body["results"]] == [["a", "bb", "ccc", "dd"][i] for i in order]
    tokens = sum(map(len, prepared.prompts))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    v2 = V2RerankResponse.model_validate(body)
    assert [(r.index, r.relevance_score) for r in v2.results] == [(r["index"], r["relevance_score"])
                                                                  for r in body["results"]]
    assert RerankResponse.model_validate(body).results[0].document.text == body["results"][0]["document"]["text"]
    every = rerank(query="q", documents=documents, return_documents=False).body(vs)["results"]
    assert len(every) == 4 and all("document" not in r for r in every)


def test_max_tokens_per_doc_cuts_each_document_to_its_first_tokens():
    prepared = rerank(query="q", documents=["abcdef", "xy"], max_tokens_per_doc=3)
    assert prepared.prompts[1:] == [ids("abcdef")[:3], ids("xy")[:3]]


@pytest.mark.parametrize("prepare, body, param, status", [
    (score, {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", 400),
    (score, {"text_1": "a", "text_2": []}, "text_2", 400),
    (score, {"text_1": "", "text_2": "a"}, "text_1", 400),
    (score, {"text_1": "a", "text_2": "x" * 70}, "text_2", 400),  # past the context
    (score, {"text_1": "a", "text_2": ["b"] * 3, "limits": RequestLimits(max_prompts=2)}, "text_2", 400),
    (score, {"text_1": "a", "text_2": "b", "model": "other"}, "model", 404),
    (rerank, {"query": "q", "documents": []}, "documents", 400),
    (rerank, {"query": "q", "documents": ["a", ""]}, "documents", 400),
    (rerank, {"query": "", "documents": ["a"]}, "query", 400),
    (rerank, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", 400),
    (rerank, {"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc", 400),
    (rerank, {"query": "q", "documents": [{"title": "a"}]}, "documents", 400),
    (rerank, {"query": "q", "documents": ["a"], "rank_fields": ["text"]}, "rank_fields", 400),
    (rerank, {"query": "q", "documents": ["a"] * 3, "limits": RequestLimits(max_prompts=2)}, "documents", 400),
    (rerank, {"query": "q", "documents": ["abc"], "limits": RequestLimits(max_prompt_chars=2)}, "documents", 413),
])
def test_a_bad_request_names_its_field(prepare, body, param, status):
    with pytest.raises(RequestError) as refused:
        prepare(**body)
    assert (refused.value.status, refused.value.param.split(".")[0]) == (status, param)


LABELS = label_token_ids(TOKENIZER, ["n", "y"])  # the demo's byte tokens


def test_with_labels_each_pair_is_one_prompt_scored_by_the_last_labels_probability():
    prepared = rerank(query="q?", documents=["ab", "cd", "ab"], labels=LABELS)
    pairs = [ids("q?") + TOKENIZER.encode(doc, add_special_tokens=False) for doc in ("ab", "cd")]
    assert prepared.prompts == pairs and prepared.pairs == [(0, 0), (1, 1), (0, 0)]  # a repeated pair runs once
    assert [p.label_token_ids for p in prepared.params] == [LABELS] * 2
    logits = [(0.5, 2.0), (1.0, -1.0)]
    expected = [float(np.exp(y) / (np.exp(n) + np.exp(y))) for n, y in logits]
    assert [r["relevance_score"] for r in prepared.body(logits)["results"]] == pytest.approx(
        [expected[0], expected[0], expected[1]])
    [one] = score(text_1="q", text_2="a", labels=LABELS[1:]).scores([(0.3,)])
    assert one == pytest.approx(1 / (1 + np.exp(-0.3)))  # one label: the sigmoid of its logit
    bare = [TOKENIZER.encode(text, add_special_tokens=False) for text in ("c", "d")]
    assert score(text_1=["a", "b"], text_2=["c", "d"], labels=LABELS).prompts == [ids("a") + bare[0],
                                                                                  ids("b") + bare[1]]


def test_a_pair_past_the_context_or_a_label_of_several_tokens_is_refused():
    with pytest.raises(RequestError) as refused:
        rerank(query="q" * 40, documents=["d" * 30], labels=LABELS)  # each fits 64 tokens, the pair not
    assert (refused.value.param, refused.value.code) == ("documents", "context_length_exceeded")
    with pytest.raises(ValueError, match="'yes' is 3 tokens"):
        label_token_ids(TOKENIZER, ["n", "yes"])
