"""Scoring pairs of texts with an embedding model, as vLLM serves one: `/score` (`text_1` against
`text_2`: one pair, one text against many, or many pairs) and `/rerank` (a query against documents,
in the shape Jina's and Cohere's rerank APIs share). Each distinct text is one embedding request
(`embedding_request`: prompt-only, its last token's hidden state), so a query scored against many
documents is embedded once; a pair's score is the cosine similarity of its two embeddings, in [-1, 1]."""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, Field

from splitserve.api.embedding_request import Inputs, embedded_prompts, several
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


@dataclass(frozen=True)
class PreparedScores:
    request: ScoreRequest | RerankRequest
    prompts: list[list[int]]  # each distinct text's token ids, embedded once
    params: list[SamplingParams]  # each one's embedding request
    pairs: list[tuple[int, int]]  # each scored pair's two texts, as positions in `prompts`
    runs_per_prompt = 1  # a text is one engine request

    def scores(self, vectors: list[tuple[float, ...]]) -> list[float]:
        """Each pair's cosine similarity, from the texts' embeddings (in `prompts`' order)."""
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
                  limits: RequestLimits) -> PreparedScores:
    """A `/score` body: RequestError (a 4xx naming the field) on a bad one."""
    body = parse_request(ScoreRequest, raw)
    lora = check_model(body.model, served)
    left, right = several(body.text_1), several(body.text_2)
    if len(left) not in (1, len(right)):
        raise RequestError(f"text_2: {len(left)} texts in text_1 against {len(right)} in text_2; send one "
                           "text_1, or one for each text_2", param="text_2")
    lefts = embedded_prompts(left, "text_1", tokenizer, max_model_len, limits)
    rights = embedded_prompts(right, "text_2", tokenizer, max_model_len, limits)
    return _prepared(body, [(lefts[k if len(lefts) > 1 else 0], right) for k, right in enumerate(rights)], lora)


def prepare_rerank(raw: bytes, tokenizer: Tokenizer, served: ModelNames, max_model_len: int,
                   limits: RequestLimits) -> PreparedScores:
    """A rerank body: RequestError (a 4xx naming the field) on a bad one."""
    body = parse_request(RerankRequest, raw)
    lora = check_model(body.model, served)
    [query] = embedded_prompts([body.query], "query", tokenizer, max_model_len, limits)
    documents = embedded_prompts(body.texts(), "documents", tokenizer, max_model_len, limits,
                                 body.max_tokens_per_doc)
    return _prepared(body, [(query, document) for document in documents], lora)


def _prepared(body: ScoreRequest | RerankRequest, pairs: list[tuple[list[int], list[int]]],
              lora: str | None) -> PreparedScores:
    """Pairs of token ids as positions in the distinct texts, each of which is embedded once."""
    position: dict[tuple[int, ...], int] = {}
    for pair in pairs:
        for ids in pair:
            position.setdefault(tuple(ids), len(position))
    prompts = [list(ids) for ids in position]
    return PreparedScores(body, prompts, [SamplingParams.embedding(lora)] * len(prompts),
                          [(position[tuple(a)], position[tuple(b)]) for a, b in pairs])


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms else 0.0
