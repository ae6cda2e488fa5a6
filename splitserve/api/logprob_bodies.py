"""OpenAI's `logprobs` objects from the engine's per-token logprobs: the legacy completions shape
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat shape (`content`: one entry
per token with its bytes, the token's own where its text cannot show them (part of a UTF-8
character), and its `top_logprobs`).

An entry is (sampled token id, {token id: logprob}) where the dict holds the `num_top` most likely
tokens and the sampled one (None for an echoed prompt's first token, which nothing predicts),
log-softmax of the raw logits (before temperature and penalties, as vLLM reports them). The top
list is the `num_top` best of the dict: were the sampled token not among them, it is the one left
out, being no likelier than any of them. A logprob below `LOGPROB_FLOOR` (-inf: a token with no
probability; NaN) is reported as the floor, as vLLM does: JSON has no infinities, and a
JavaScript client's parser refuses them. With vLLM's `return_tokens_as_token_ids` a token is
named `token_id:{id}` (`token_id_name`), so tokens whose text is not valid UTF-8 on its own, or
that share a text, stay apart; offsets and bytes stay the text's.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

Entry = tuple[int, dict[int, float] | None]
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]
LOGPROB_FLOOR = -9999.0


def token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def completion_logprobs(entries: Sequence[Entry], num_top: int, token_text: TokenText, offset: int = 0,
                        name: TokenText | None = None) -> dict:
    """`offset`: where the first token's text starts in the choice's text (streamed chunks go on);
    `name`: how the tokens are named (None: by their text)."""
    name = name or token_text
    offsets, at = [], offset
    for token_id, _ in entries:
        offsets.append(at)
        at += len(token_text(token_id))
    return {"tokens": [name(token_id) for token_id, _ in entries],
            "token_logprobs": [None if lps is None else _reported(lps[token_id]) for token_id, lps in entries],
            "top_logprobs": [None if lps is None else {name(t): lp for t, lp in _top(lps, num_top)}
                             for _, lps in entries],
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[Entry], num_top: int, token_text: TokenText, token_bytes: TokenBytes) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": token_text(token_id), "logprob": _reported(logprob), "bytes": list(token_bytes(token_id))}

    return {"content": [{**item(token_id, lps[token_id]), "top_logprobs": [item(t, lp) for t, lp in _top(lps, num_top)]}
                        for token_id, lps in entries]}


def _top(logprobs: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(((t, _reported(lp)) for t, lp in logprobs.items()), key=lambda item: -item[1])[:num_top]


def _reported(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False: the floor too
