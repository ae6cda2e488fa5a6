"""The requests answered from their texts' pooled outputs (each text a prompt-only request, run
whole on a prompt worker): embeddings, scores and reranks, prepared by kind from their bodies, for
the HTTP endpoints and batch lines alike."""
from __future__ import annotations

from splitserve.api.embedding_request import PreparedEmbeddings, prepare_embeddings
from splitserve.api.limits import RequestLimits
from splitserve.api.request_models import ModelNames
from splitserve.api.score_request import PreparedScores, prepare_rerank, prepare_score
from splitserve.engine.tokenizer import Tokenizer

POOLED_KINDS = ("embedding", "score", "rerank")


def prepare_pooled(kind: str, raw: bytes, tokenizer: Tokenizer, served: ModelNames, max_model_len: int,
                   limits: RequestLimits, hidden_size: int, score_labels: tuple[int, ...] = ()
                   ) -> PreparedEmbeddings | PreparedScores:
    """A body of `kind` (one of POOLED_KINDS) prepared as its endpoint takes it; `hidden_size`: the
    most `dimensions` an embedding may ask; `score_labels`: a token-answering reranker's label ids
    (else scores by embeddings). RequestError (a 4xx naming the field) on a bad body."""
    if kind == "embedding":
        return prepare_embeddings(raw, tokenizer, served, max_model_len, limits, hidden_size)
    prepare = prepare_score if kind == "score" else prepare_rerank
    return prepare(raw, tokenizer, served, max_model_len, limits, score_labels)
