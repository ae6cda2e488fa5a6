"""`/score` and `/rerank` through a real local cluster: a pair's score is the cosine similarity of
the offline engine's embeddings (`LLM.embed`) of its texts, and Cohere's own client reads the
rerank at `/v2/rerank`, best first; on an app serving a reranker that answers in tokens (the
tensor-parallel one), a pair's score is the offline engine's label logits' verdict."""
from __future__ import annotations

import cohere
import httpx
import numpy as np
import pytest

from splitserve import SamplingParams

QUERY = "Where is the Eiffel Tower?"
DOCUMENTS = ["The Eiffel Tower is in Paris.", "Bananas are yellow.", "Paris is the capital of France."]


def cosines(offline, query: str, documents: list[str]) -> list[float]:
    [q], docs = offline.embed([query]), offline.embed(documents)
    return [float(np.dot(q, d) / (np.linalg.norm(q) * np.linalg.norm(d))) for d in docs]


def test_cohere_s_client_reranks_by_the_engine_s_embeddings(server, offline):
    client = cohere.ClientV2(base_url=server, api_key="unused")
    got = client.rerank(model="demo", query=QUERY, documents=DOCUMENTS, top_n=2)
    expected = cosines(offline, QUERY, DOCUMENTS)
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r.index for r in got.results] == best
    assert [r.relevance_score for r in got.results] == pytest.approx([expected[i] for i in best], abs=1e-5)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_pairs_one_text_with_many(server, offline, path):
    answer = httpx.post(f"{server}{path}", json={"model": "demo", "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(cosines(offline, QUERY, DOCUMENTS), abs=1e-5)
    tokenizer = offline.get_tokenizer()
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in [QUERY, *DOCUMENTS])


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
])
def test_a_bad_request_is_a_4xx_naming_its_field(server, path, body, param):
    answer = httpx.post(f"{server}{path}", json={"model": "demo", **body}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"].split(".")[0] == param


def test_a_reranker_answering_in_tokens_scores_each_pair_by_its_label_logits(tp_server, offline):
    """`score_label_tokens: ["n", "y"]`: a pair is the query's tokens then the document's (no
    special tokens), run as one prompt on the tensor-parallel prompt worker; its score is y's
    probability against n's, from the logits the offline engine gives those two tokens."""
    tokenizer = offline.get_tokenizer()
    labels = (tokenizer.encode("n", add_special_tokens=False)[0], tokenizer.encode("y", add_special_tokens=False)[0])
    pairs = [tokenizer.encode(QUERY) + tokenizer.encode(doc, add_special_tokens=False) for doc in DOCUMENTS]
    logits = [out.embedding for out in offline.generate([{"prompt_token_ids": p} for p in pairs],
                                                        SamplingParams.embedding(label_token_ids=labels))]
    expected = [1 / (1 + np.exp(n - y)) for n, y in logits]
    got = httpx.post(f"{tp_server}/rerank", json={"model": "demo", "query": QUERY, "documents": DOCUMENTS},
                     timeout=60).json()
    assert [r["index"] for r in got["results"]] == sorted(range(3), key=lambda i: -expected[i])
    assert [r["relevance_score"] for r in got["results"]] == pytest.approx(
        [expected[r["index"]] for r in got["results"]], abs=1e-5)
    assert got["usage"]["prompt_tokens"] == sum(map(len, pairs))
