"""Per-iteration attention metadata, built by the model runner and passed explicitly to every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Tokens are flattened, sequence after sequence; the first `num_decodes` sequences have a
    single query token each (decodes, batched together), the rest are prefill chunks.

    Sequence i owns query tokens [query_starts[i], query_starts[i+1]); its context (earlier KV
    plus this chunk) is `context_lens[i]` tokens long, so its first query sits at position
    context_lens[i] - query_len. `slot_mapping[t]` is the flat cache slot (block * block_size +
    offset) that token t's K and V are written to before attention runs.
    """

    slot_mapping: torch.Tensor        # [num_tokens] int64
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor        # [num_seqs] int64
    query_starts: list[int]           # num_seqs + 1 offsets into the flat tokens
    context_lens_list: list[int]
    num_decodes: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)
