"""Scoring pairs of texts, as vLLM serves it: `/score` (`text_1` against `text_2`: one pair, one
text against many, or many pairs) and `/rerank` (a query against documents, in the shape Jina's and
Cohere's rerank APIs share). Two ways, by the model:
- an embedding model: each distinct text is one embedding request (`embedding_request`: prompt-only,
  its last token's hidden state), so a query scored against many documents is embedded once; a
  pair's score is the cosine similarity of its two embeddings, in [-1, 1];
- a reranker that answers in tokens (`score_label_tokens`: Qwen3-Reranker's "no" and "yes"): each
  pair is one prompt, the first text's tokens then the second's (without special tokens), whose
  logits at the label tokens (`SamplingParams.label_token_ids`) give its score, in [0, 1]: the
  probability of the last label against the first (one label: the sigmoid of its logit)."""
from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, Field

from splitserve.api.embedding_request import Inputs, check_context, embedded_prompts, several
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import ModelNames, check_model, parse_request
from splitserve.api.strict_model import STRICT
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer


class ScoreRequest(BaseModel):
    """vLLM's `/score`: `text_1` one text, or as many as `text_2`."""
    model_config = STRICT
    model: str
    text_1: Inputs
    text_2: Inputs
    user: str | None = None


class RerankDocument(BaseModel):
    model_config = STRICT
    text: str


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank request (Cohere's client sends `max_tokens_per_doc`: a longer
    document is cut to its first that many tokens, as Cohere cuts it)."""
    model_config = STRICT
    model: str
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1)]
    top_n: Annotated[int | None, Field(ge=0)] = None  # the best n; None or 0: every document
    return_documents: bool = True
    max_tokens_per_doc: Annotated[int | None, Field(ge=1)] = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


def label_token_ids(tokenizer: Tokenizer, labels: Sequence[str]) -> tuple[int, ...]:
    """`score_label_tokens` as ids; ValueError naming one that is not a single token."""
    ids = []
    for label in labels:
        encoded = tokenizer.encode(label, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"score_label_tokens: {label!r} is {len(encoded)} tokens in this model's vocabulary "
                             f"({encoded}); each label must be one token")
        ids += encoded
    return tuple(ids)


@dataclass(frozen=True)
class PreparedScores:
    request: ScoreRequest | RerankRequest
    prompts: list[list[int]]  # each prompt to run once: a distinct text, or with labels a pair
    params: list[SamplingParams]  # each one's embedding request
    pairs: list[tuple[int, int]]  # each scored pair's two texts as positions in `prompts`; with labels, its own twice
    labels: bool  # whether a prompt's pooled output is its label logits (else its embedding)
    runs_per_prompt = 1  # a prompt is one engine request

    def scores(self, vectors: list[tuple[float, ...]]) -> list[float]:
        """Each pair's score, from the prompts' pooled outputs (in `prompts`' order)."""
        if self.labels:
            return [_verdict(vectors[a]) for a, _ in self.pairs]
        return [_cosine(vectors[a], vectors[b]) for a, b in self.pairs]

    def body(self, vectors: list[tuple[float, ...]]) -> dict:
        """The endpoint's response: vLLM's score list, or the rerank results, best first."""
        scores, tokens = self.scores(vectors), sum(map(len, self.prompts))
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        if isinstance(self.request, ScoreRequest):
            data = [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)]
            return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": self.request.model, "data": data, "usage": usage}
        texts, ranked = self.request.texts(), sorted(range(len(scores)), key=lambda i: -scores[i])
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if self.request.return_documents else {})}
                   for i in ranked[:self.request.top_n or None]]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.request.model, "usage": usage, "results": results}


def prepare_score(raw: bytes, tokenizer: Tokenizer, served: ModelNames, max_model_len: int,
                  limits: RequestLimits, labels: tuple[int, ...] = ()) -> PreparedScores:
    """A `/score` body (`labels`: the reranker's label token ids, else by embeddings):
    RequestError (a 4xx naming the field) on a bad one."""
    body = parse_request(ScoreRequest, raw)
    lora = check_model(body.model, served)
    left, right = several(body.text_1), several(body.text_2)
    if len(left) not in (1, len(right)):
        raise RequestError(f"text_2: {len(left)} texts in text_1 against {len(right)} in text_2; send one "
                           "text_1, or one for each text_2", param="text_2")
    lefts = embedded_prompts(left, "text_1", tokenizer, max_model_len, limits)
    rights = embedded_prompts(right, "text_2", tokenizer, max_model_len, limits, add_special_tokens=not labels)
    pairs = [(lefts[k if len(lefts) > 1 else 0], right) for k, right in enumerate(rights)]
    return _prepared(body, pairs, lora, labels, max_model_len, "text_2")


def prepare_rerank(raw: bytes, tokenizer: Tokenizer, served: ModelNames, max_model_len: int,
                   limits: RequestLimits, labels: tuple[int, ...] = ()) -> PreparedScores:
    """A rerank body (`labels`: as `prepare_score`'s): RequestError (a 4xx naming the field) on a bad one."""
    body = parse_request(RerankRequest, raw)
    lora = check_model(body.model, served)
    [query] = embedded_prompts([body.query], "query", tokenizer, max_model_len, limits)
    documents = embedded_prompts(body.texts(), "documents", tokenizer, max_model_len, limits,
                                 body.max_tokens_per_doc, add_special_tokens=not labels)
    return _prepared(body, [(query, document) for document in documents], lora, labels, max_model_len, "documents")


def _prepared(body: ScoreRequest | RerankRequest, pairs: list[tuple[list[int], list[int]]], lora: str | None,
              labels: tuple[int, ...], max_model_len: int, field: str) -> PreparedScores:
    """The prompts to run once each, and each pair's positions among them: the distinct texts,
    or with `labels` the distinct pairs, each the first text's tokens then the second's (a 400
    naming `field` for one past the context)."""
    if labels:
        check_context(max(len(a) + len(b) for a, b in pairs), max_model_len, field)
        pairs = [(a + b, a + b) for a, b in pairs]
    position: dict[tuple[int, ...], int] = {}
    for pair in pairs:
        for ids in pair:
            position.setdefault(tuple(ids), len(position))
    prompts = [list(ids) for ids in position]
    return PreparedScores(body, prompts, [SamplingParams.embedding(lora, labels)] * len(prompts),
                          [(position[tuple(a)], position[tuple(b)]) for a, b in pairs], bool(labels))


def _verdict(logits: tuple[float, ...]) -> float:
    """The last label's probability among the labels (one label: the sigmoid of its logit)."""
    rest = [0.0] if len(logits) == 1 else logits[:-1]
    top = max(logits[-1], *rest)
    return math.exp(logits[-1] - top) / math.fsum(math.exp(x - top) for x in (logits[-1], *rest))


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms else 0.0
