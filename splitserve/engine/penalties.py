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

from array import array

import torch

from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import upload, upload_list

ROW_BYTES_PER_ID = 4 + 1  # a kept row's float32 count and bool mark of each vocabulary id


class Penalties:
    """Applies a batch's biases and penalties. It keeps each penalized sequence's counts on the
    logits' device, a row of two pools: how often each id occurs in its output, and whether it
    occurs at all (prompt or output). A step counts only what each sequence appended since
    (`token_ids` only grows), so its host work and upload follow the new tokens, not the contexts.
    It holds the latest call's sequences alone: one that ends or sits a step out gives its row
    back, and is counted whole again if it returns. The pools grow to the most penalized sequences
    of one step (at most max_num_seqs rows of the vocabulary, `ROW_BYTES_PER_ID`) and are let go
    by a step with none."""

    def __init__(self) -> None:
        self._let_go(0, torch.device("cpu"))

    def _let_go(self, vocab: int, device: torch.device) -> None:
        """No rows held: every sequence is counted whole when it comes."""
        self._rows: dict[Sequence, tuple[int, int]] = {}  # seq -> (its row of the pools, its tokens counted)
        self._output = torch.zeros(0, vocab, device=device)  # [rows, vocab] float32: each id's count in the output
        self._seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)  # [rows, vocab]: in prompt or output

    def apply(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[tuple[int, ...]] | None = None
              ) -> torch.Tensor:
        """`drafted`: per row, the drafts before it (`Sampler.draw`: a drafting sequence's rows come
        in order): they count as its output for that row."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            if self._rows:
                self._let_go(0, torch.device("cpu"))
            return logits
        device = logits.device
        chosen = [seqs[i] for i in rows]
        unique = chosen if drafted is None else list(dict.fromkeys(chosen))  # drafting: a row per draft, 1 more
        index, slots = self._count(unique, rows, logits.shape[1], device)
        if len(unique) < len(chosen):
            of = {seq: k for k, seq in enumerate(unique)}
            slots = slots[upload_list([of[seq] for seq in chosen], torch.long, device)]
        part = _add_biases(logits[index], chosen)  # the bias first, as vLLM and transformers order them
        banned = part.isneginf()  # stays -inf (token_bans); any other logit stays finite, overflowed or not
        output_counts, seen = self._output[slots], self._seen[slots]
        if drafted is not None:
            output_counts, seen = _with_drafts(output_counts, seen, [drafted[i] for i in rows])
        repetition = _column([s.params.repetition_penalty for s in chosen], device)
        penalized = torch.where(part > 0, part / repetition, part * repetition)
        part = torch.where(seen, penalized, part)
        part = part - _column([s.params.frequency_penalty for s in chosen], device) * output_counts
        part = part - _column([s.params.presence_penalty for s in chosen], device) * output_counts.gt(0)
        big = torch.finfo(part.dtype).max  # a penalty may overflow a huge logit: kept finite, as the sampler's input is
        logits = logits.clone()
        logits[index] = torch.nan_to_num(part, nan=float("-inf"), posinf=big, neginf=-big).masked_fill(banned,
                                                                                                       float("-inf"))
        return logits

    def _count(self, seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each of `seqs` appended since the last call, counted into its row (a new one's whole
        context into a zeroed row); on the device, in one upload: the batch's `rows` and the pools'
        rows of `seqs`. An id outside the vocabulary is not counted."""
        if self._output.shape[1] != vocab or self._output.device != device:
            self._let_go(vocab, device)
        held, self._rows = self._rows, {}
        kept = {held[seq][0] for seq in seqs if seq in held}
        free = [row for row in range(len(self._output)) if row not in kept]
        extra = len(seqs) - len(kept) - len(free)
        if extra > 0:
            free += range(len(self._output), len(self._output) + extra)
            self._output = torch.cat([self._output, self._output.new_zeros(extra, vocab)])
            self._seen = torch.cat([self._seen, self._seen.new_zeros(extra, vocab)])
        slots, fresh, new = [], [], []  # `new`: each sequence's tokens from its first uncounted one, end to end
        offsets, firsts, first_outputs, lengths = [], [], [], []  # per sequence, for its run of `new`
        for seq in seqs:
            row, counted = held.get(seq, (None, 0))
            if row is None:
                row = free.pop()
                fresh.append(row)
            tokens = seq.token_ids
            new += tokens[counted:]
            offsets.append(row * vocab)  # its row's start in the flattened pools
            firsts.append(counted)  # the number of its first new token
            first_outputs.append(seq.num_prompt_tokens - seq.params.resumed_tokens)
            lengths.append(len(tokens) - counted)
            self._rows[seq] = (row, len(tokens))
            slots.append(row)
        offset, first, first_output, lengths = torch.tensor([offsets, firsts, first_outputs, lengths],
                                                            dtype=torch.long)
        ids = torch.frombuffer(array("q", new), dtype=torch.long) if new else torch.zeros(0, dtype=torch.long)
        starts = (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        numbers = torch.arange(len(ids)) - starts + first.repeat_interleave(lengths)  # each new token's in its sequence
        valid = (ids >= 0) & (ids < vocab)
        positions = ids + offset.repeat_interleave(lengths)
        seen, output = positions[valid], positions[valid & (numbers >= first_output.repeat_interleave(lengths))]
        lists = torch.tensor(rows + slots + fresh, dtype=torch.long)
        index, slots_on, fresh_on, seen_on, output_on = upload(torch.cat([lists, seen, output]), device).split(
            [len(rows), len(slots), len(fresh), len(seen), len(output)])
        self._output[fresh_on] = 0
        self._seen[fresh_on] = False
        self._seen.view(-1)[seen_on] = True
        self._output.view(-1).index_add_(0, output_on, self._output.new_ones(1).expand(len(output_on)))
        return index, slots_on


def _with_drafts(output_counts: torch.Tensor, seen: torch.Tensor, drafted: list[tuple[int, ...]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's counts with the drafts before it counted in (rows gathered from the pools: copies)."""
    vocab = output_counts.shape[1]
    flat = [row * vocab + t for row, tokens in enumerate(drafted) for t in tokens if 0 <= t < vocab]
    if flat:
        positions = upload_list(flat, torch.long, output_counts.device)
        output_counts.view(-1).index_add_(0, positions, output_counts.new_ones(1).expand(len(flat)))
        seen.view(-1)[positions] = True
    return output_counts, seen


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
