"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt position after the first, the
logprob of the prompt's own token there and of the most likely tokens, taken from the prefill's
own forward pass. Chunked prefills hand in their rows chunk by chunk."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.sampler import sanitized_logits
from splitserve.engine.sequence import Sequence

ROWS_PER_PASS = 256  # logits of this many positions at a time: bounds the [rows, vocab] float32 buffer


@dataclass(frozen=True)
class PromptRows:
    """Final hidden states of part of a prompt: row i predicts prompt position `first_position + i`."""

    seq: Sequence
    first_position: int
    hidden: torch.Tensor


@torch.inference_mode()
def prompt_logprobs(compute_logits, rows: PromptRows) -> list[dict[int, float]]:
    """{token id: logprob} per row: the prompt's token at that position, and the
    `params.prompt_logprobs` most likely tokens; log_softmax of the raw logits, as for sampled tokens."""
    num_top = rows.seq.params.prompt_logprobs
    n = rows.hidden.shape[0]
    targets = rows.seq.prompt_token_ids[rows.first_position:rows.first_position + n]
    out: list[dict[int, float]] = []
    for a in range(0, n, ROWS_PER_PASS):
        logprobs = sanitized_logits(compute_logits(rows.hidden[a:a + ROWS_PER_PASS]).float()).log_softmax(dim=-1)
        wanted = torch.tensor(targets[a:a + ROWS_PER_PASS], device=logprobs.device)
        chosen = logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = (x.tolist() for x in logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1))
        for i, token_id in enumerate(wanted.tolist()):
            out.append({**dict(zip(top_ids[i], top_values[i])), token_id: chosen[i]})
    return out
