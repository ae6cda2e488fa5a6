"""Tokens a request may not sample, set to -inf on a batch's logits before its biases and
penalties (vLLM's order): every id outside its `allowed_token_ids` (an id past the vocabulary
allows nothing), and what its `bad_words` ban after the output so far (`bad_words`). Rows
without either cost nothing."""
from __future__ import annotations

import torch

from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import upload_list


class TokenBans:
    """Applies a batch's bans. A sequence's allowed ids reach the device once, as a mask row it keeps
    while it is in every call (at most max_num_seqs rows of the vocabulary in bools); the bad words'
    few ids each step."""

    def __init__(self) -> None:
        self._allowed: dict[Sequence, torch.Tensor] = {}  # seq -> [vocab] bool on the logits' device

    def apply(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[tuple[int, ...]] | None = None
              ) -> torch.Tensor:
        """`logits` [rows, vocab] with each row's banned ids at -inf (a new tensor where a row bans any).
        `drafted`: per row, the drafts before it (`Sampler.draw`): its bad words follow them too."""
        allowed, kept, banned_rows, banned_cols = [], {}, [], []
        for row, seq in enumerate(seqs):
            if seq.params.allowed_token_ids is not None:
                allowed.append(row)
                if seq not in kept:  # a drafting sequence's rows share one
                    kept[seq] = self._allowed_row(seq, logits)
            if seq.bad_words is not None:
                tokens = seq.token_ids + list(drafted[row]) if drafted is not None and drafted[row] else seq.token_ids
                ids = [t for t in seq.bad_words.banned(tokens, seq.num_prompt_tokens - seq.params.resumed_tokens)
                       if t < logits.shape[1]]
                banned_rows += [row] * len(ids)
                banned_cols += ids
        self._allowed = kept
        if not allowed and not banned_rows:
            return logits
        keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        if allowed:
            keep[upload_list(allowed, torch.long, logits.device)] = torch.stack([kept[seqs[row]] for row in allowed])
        if banned_rows:
            index = upload_list([banned_rows, banned_cols], torch.long, logits.device)
            keep[index[0], index[1]] = False
        return logits.masked_fill(~keep, float("-inf"))

    def _allowed_row(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        row = self._allowed.get(seq)
        if row is None or row.shape[0] != logits.shape[1] or row.device != logits.device:
            vocab = logits.shape[1]
            row = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            row[upload_list([t for t in seq.params.allowed_token_ids if t < vocab], torch.long, logits.device)] = True
        return row
