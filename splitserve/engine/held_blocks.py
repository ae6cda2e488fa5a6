"""What `BlockManager` keeps of one sequence: its block tables and the state of their hashing,
releasing and chunk-by-chunk growth."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HeldBlocks:
    tables: list[list[int]]  # per group: block ids in token order
    released: list[int]      # per group: the table's leading NULL_BLOCKs
    done: int                # leading blocks hashed, in every group (the chain's progress)
    parent: int              # hash of block done - 1's key, or the chain's root
    chunk: int = 0           # taken chunk by chunk, at most this many tokens a step (0: not, or done)
    prefill_to: int = 0      # ... until this many tokens are computed
    promised: int = 0        # free blocks kept for the rest of its prefill
    keep: tuple[int, ...] | None = None  # per group: the first block it never releases (None: no bound)
