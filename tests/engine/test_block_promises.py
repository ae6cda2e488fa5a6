"""`BlockPromises`: a prompt's peak blocks while it is prefilled in chunks bounds what a brute-force
walk of every chunking holds, and promises never pass the free blocks others have not been promised."""
from __future__ import annotations

import itertools

import pytest

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.block_promises import BlockPromises

BS = 4


def held_at_once(num_tokens: int, window: int | None, cuts: list[int]) -> int:
    """The most blocks a table holds while chunks [cuts[i], cuts[i + 1]) are computed: from the
    block a chunk's first query reaches back to, to the block of its last token."""
    most = 0
    for start, end in itertools.pairwise(cuts):
        first = 0 if window is None else max(0, start - window + 1) // BS
        most = max(most, (end - 1) // BS + 1 - first)
    return most


@pytest.mark.parametrize("window", [None, 1, 5, 8, 13])
@pytest.mark.parametrize("chunk", [1, 3, 4, 9])
def test_no_chunking_holds_more_than_the_peak(window, chunk):
    promises = BlockPromises(BlockPool(64, 1, 1), [window], BS)
    for num_tokens in range(1, 30):
        peak = promises.peak(num_tokens, [0], chunk)
        assert peak == promises.peak(num_tokens, [0], None) or window is not None
        for first in range(1, min(chunk, num_tokens) + 1):  # the first chunk's size sets the alignment
            cuts = [0, *range(first, num_tokens, chunk), num_tokens]
            assert held_at_once(num_tokens, window, cuts) <= peak, (num_tokens, cuts)
    assert promises.peak(40, [3], None) == 10 - 3  # whole, its released entries aside


def test_promises_are_free_blocks_not_promised_to_others():
    pool = BlockPool(11, 1, 1)  # 10 free blocks
    promises = BlockPromises(pool, [8], BS)
    first = promises.settle(0, 6)
    second = promises.settle(0, 6)  # only 4 are left unpromised
    assert (first, second, promises.total) == (6, 4, 10)
    promises.check([first, second])
    pool.take_fresh(2)  # a grow draws 2 of the first's
    first = promises.settle(first, 4)
    assert (first, promises.unpromised(first)) == (4, 4)
    promises.check([first, second])
    with pytest.raises(RuntimeError, match="promised"):
        promises.check([first])  # a promise nobody holds
    first = promises.settle(first, 0)  # its prefill ended
    assert promises.total == second
