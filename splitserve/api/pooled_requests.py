"""The requests answered from their texts' pooled outputs (each text a prompt-only request, run
whole on a prompt worker): embeddings, scores and reranks, by kind, each prepared from its body as
`prepare(raw, tokenizer, served, max_model_len, limits)`, for the HTTP endpoints and batch lines alike."""
from __future__ import annotations

import functools
from collections.abc import Callable

from splitserve.api.embedding_request import PreparedEmbeddings, prepare_embeddings
from splitserve.api.score_request import PreparedScores, prepare_rerank, prepare_score

PooledPrepare = Callable[..., PreparedEmbeddings | PreparedScores]


def pooled_preparers(hidden_size: int, score_labels: tuple[int, ...] = ()) -> dict[str, PooledPrepare]:
    """kind ("embedding", "score", "rerank") -> its preparer; `hidden_size`: the most `dimensions`
    an embedding may ask; `score_labels`: a token-answering reranker's label ids (else scores by
    embeddings)."""
    return {"embedding": functools.partial(prepare_embeddings, hidden_size=hidden_size),
            "score": functools.partial(prepare_score, labels=score_labels),
            "rerank": functools.partial(prepare_rerank, labels=score_labels)}
