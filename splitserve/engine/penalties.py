"""Biases and penalties on a batch's logits, in one batched pass on the logits' device, before
sampling (greedy rows too), as vLLM and OpenAI define them, in this order:

- `logit_bias`: added to the token's logit (transformers' `SequenceBiasLogitsProcessor` for
  single tokens); ids outside the vocabulary are ignored;
- repetition (`repetition_penalty`, 1: off): a logit of a token in the prompt or the output so
  far is divided by the penalty when positive, multiplied when negative (transformers'
  `RepetitionPenaltyLogitsProcessor`);
- frequency and presence (OpenAI's): `logit -= frequency_penalty * count + presence_penalty *
  (count > 0)`, counting the output tokens only (a resumed request's earlier output included).

Rows without any of these cost nothing; the others are gathered, changed and written back.
"""
from __future__ import annotations

import torch

from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import upload, upload_list

DEVICE_BYTES_PER_TOKEN = 8 + 4  # a counted token's int64 index and float32 one, while `_counts` runs


class Penalties:
    """Applies a batch's biases and penalties. It keeps each penalized sequence's tokens as a host
    tensor, extended each step by what the sequence appended since (`token_ids` only grows): a step
    converts its new tokens from Python, not every context again. It holds the latest call's
    sequences alone, so a sequence that ends or sits a step out is let go."""

    def __init__(self) -> None:
        self._tokens: dict[Sequence, tuple[torch.Tensor, int]] = {}  # seq -> (buffer, tokens filled)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            self._tokens = {}
            return logits
        device, vocab = logits.device, logits.shape[1]
        chosen = [seqs[i] for i in rows]
        tokens = self._token_tensors(chosen)
        index = upload_list(rows, torch.long, device)
        part = _add_biases(logits[index], chosen)  # the bias first, as vLLM and transformers order them
        generated = [t[s.num_prompt_tokens - s.params.resumed_tokens:] for s, t in zip(chosen, tokens)]
        output_counts = _counts(generated, vocab, device)
        seen = _counts(tokens, vocab, device).gt(0)  # in the prompt or the output
        repetition = _column([s.params.repetition_penalty for s in chosen], device)
        penalized = torch.where(part > 0, part / repetition, part * repetition)
        part = torch.where(seen, penalized, part)
        part = part - _column([s.params.frequency_penalty for s in chosen], device) * output_counts
        part = part - _column([s.params.presence_penalty for s in chosen], device) * output_counts.gt(0)
        big = torch.finfo(part.dtype).max  # a penalty may overflow a huge logit: kept finite, as the sampler's input is
        logits = logits.clone()
        logits[index] = torch.nan_to_num(part, nan=float("-inf"), posinf=big, neginf=float("-inf"))
        return logits

    def _token_tensors(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Each sequence's `token_ids` as an int64 tensor (a view of its buffer, which at least doubles
        when it fills)."""
        held, self._tokens = self._tokens, {}
        views = []
        for seq in seqs:
            buffer, filled = held.get(seq, (torch.empty(0, dtype=torch.long), 0))
            total = seq.num_tokens
            if total > len(buffer):
                grown = torch.empty(max(total, 2 * len(buffer)), dtype=torch.long)
                grown[:filled] = buffer[:filled]
                buffer = grown
            buffer[filled:total] = torch.tensor(seq.token_ids[filled:total], dtype=torch.long)
            self._tokens[seq] = (buffer, total)
            views.append(buffer[:total])
        return views


def _counts(token_lists: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrences of each id: one index_add over the lists laid end to end (row r's id
    t at r * vocab + t; an id outside the vocabulary is dropped). Its device memory follows the lists'
    total length (`DEVICE_BYTES_PER_TOKEN`), not rows x the longest."""
    rows = len(token_lists)
    ids = torch.cat(token_lists)
    offsets = torch.arange(rows).repeat_interleave(torch.tensor([len(t) for t in token_lists])) * vocab
    flat = upload((ids + offsets)[(ids >= 0) & (ids < vocab)], device)
    counts = torch.zeros(rows * vocab, device=device)
    counts.index_add_(0, flat, torch.ones(1, device=device).expand(len(flat)))
    return counts.view(rows, vocab)


def _add_biases(part: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Adds each row's logit_bias where it names a token of the vocabulary (only those entries move)."""
    entries = [(row, token_id, value) for row, seq in enumerate(seqs) for token_id, value in seq.params.logit_bias
               if token_id < part.shape[1]]
    if not entries:
        return part
    rows, cols, values = (upload(torch.tensor(x), part.device) for x in zip(*entries))
    return part.index_put((rows, cols), values.to(part.dtype), accumulate=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return upload_list(values, torch.float32, device).unsqueeze(1)
