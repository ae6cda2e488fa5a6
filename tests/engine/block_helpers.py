"""Small helpers shared by the `BlockManager` tests (test_block_manager, test_prefix_cache,
test_block_manager_stress)."""
from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

BS = 4


def make_seq(seq_id: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=max_tokens))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a step computed every token of `seq`, then commit."""
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def seq_range(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def cached(bm: BlockManager, seq_id: str, tokens: list[int]) -> Sequence:
    """Make a sequence, allocate it and compute it fully (committing its full blocks)."""
    seq = make_seq(seq_id, tokens)
    bm.allocate(seq)
    compute_all(bm, seq)
    return seq
