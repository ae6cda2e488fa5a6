"""Per-iteration attention metadata, built by the model runner and passed explicitly to every layer."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

PAD_SLOT = -1  # the slot of a padding row (a captured batch's unused rows): its K and V are stored nowhere
SHORT_CHUNK = 32  # query tokens of the longest chunk that `chunk_runs` batches with others
GROUP_RATIO = 0.6  # a batched group's shortest context is at least this share of its longest


@dataclass(frozen=True)
class AttentionMetadata:
    """Tokens are flattened, sequence after sequence; the first `num_decodes` sequences have a
    single query token each (decodes), the rest are prefill chunks. Decodes are attended in
    `decode_groups`: (first, end) ranges of sequences with similar context lengths, so that
    each group pads its keys only to its own longest context.

    Sequence i owns query tokens [query_starts[i], query_starts[i+1]); its context (earlier KV
    plus this chunk) is `context_lens[i]` tokens long, so its first query sits at position
    context_lens[i] - query_len. `slot_mapping[t]` is the flat cache slot (block * block_size +
    offset) that token t's K and V are written to before attention runs. `context_lens_list` is
    exact, except in a captured decode step (`cuda_graphs`), where it is max_model_len for every
    sequence: only backends that are `graph_safe` run those, and they read it only as a bound.
    """

    slot_mapping: torch.Tensor        # [num_tokens] int64
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor        # [num_seqs] int64
    query_starts: list[int]           # num_seqs + 1 offsets into the flat tokens
    context_lens_list: list[int]
    num_decodes: int
    decode_groups: tuple[tuple[int, int], ...] = ()  # default: all decodes in one group
    query_start_tensor: torch.Tensor | None = None  # query_starts on the device (kernels that launch once)

    def __post_init__(self) -> None:
        if not self.decode_groups and self.num_decodes:
            object.__setattr__(self, "decode_groups", ((0, self.num_decodes),))

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @cached_property
    def fresh_from(self) -> int:
        """The first of the fresh prompts (prefill chunks that are their sequence's whole context)
        at the batch's end, where the runner puts them after chunks with earlier context;
        num_seqs where the last sequence is not one. Once per step, not per layer."""
        starts, first = self.query_starts, self.num_seqs
        while first > self.num_decodes and starts[first] - starts[first - 1] == self.context_lens_list[first - 1]:
            first -= 1
        return first

    @cached_property
    def fresh_query_starts(self) -> torch.Tensor:
        """The fresh prompts' query offsets, counted from the first one's first token (int32 on the
        device, the varlen kernels' cu_seqlens)."""
        return (self.query_start_tensor[self.fresh_from:] - self.query_starts[self.fresh_from]).to(torch.int32)

    @cached_property
    def fresh_longest(self) -> int:
        """The longest fresh prompt's length (0 where none)."""
        return self.longest_query(self.fresh_from, self.num_seqs)

    @cached_property
    def chunk_runs(self) -> tuple[tuple[int, int], ...]:
        """The prefill chunks as (first, end) runs of sequences: a run of several is chunks of one
        query length, at most SHORT_CHUNK tokens, each after earlier context (a decode and its
        drafts), their contexts within group_by_length's ratio of the run's first; any other chunk
        is a run of its own."""
        starts, lens, runs = self.query_starts, self.context_lens_list, []
        for i in range(self.num_decodes, self.num_seqs):
            n = starts[i + 1] - starts[i]
            if runs and _joins(runs[-1], i, n, starts, lens):
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        return tuple((first, end) for first, end in runs)

    def longest_query(self, first: int, end: int) -> int:
        """The most query tokens any of sequences first .. end has (0 where none)."""
        starts = self.query_starts
        return max((starts[i + 1] - starts[i] for i in range(first, end)), default=0)


def _joins(run: list[int], i: int, n: int, starts: list[int], lens: list[int]) -> bool:
    """Whether chunk i, of n query tokens, joins `run` (see AttentionMetadata.chunk_runs)."""
    first = run[0]
    return (n <= SHORT_CHUNK and n < lens[i] and starts[first + 1] - starts[first] == n
            and lens[first] > n and lens[i] >= GROUP_RATIO * lens[first])


def group_by_length(context_lens: list[int], min_ratio: float = GROUP_RATIO) -> tuple[tuple[int, int], ...]:
    """Split a list sorted longest first into runs whose shortest is >= min_ratio of their
    longest, bounding padding waste while keeping few attention calls."""
    groups, first = [], 0
    for i, length in enumerate(context_lens):
        if length < min_ratio * context_lens[first]:
            groups.append((first, i))
            first = i
    if context_lens:
        groups.append((first, len(context_lens)))
    return tuple(groups)
