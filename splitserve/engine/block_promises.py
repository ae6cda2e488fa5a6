"""Free blocks promised to prompts that a model with a windowed layer group prefills chunk by
chunk (`BlockManager.allocate(chunk_tokens=...)`).

Such a prompt takes its blocks as its chunks go, yet its admission guarantees the rest of its
prefill: the most blocks it can hold at once while it is prefilled (`peak`), less those it holds,
are promised to it and counted out of the free blocks others may take. A promise is always free
blocks: the promises' sum (`total`) never passes the pool's free blocks.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from splitserve.engine.block_pool import BlockPool


class BlockPromises:
    def __init__(self, pool: BlockPool, windows: Seq[int | None], block_size: int):
        self._pool, self._windows, self._block_size = pool, tuple(windows), block_size
        self.total = 0  # the sum of the sequences' promises

    def peak(self, num_tokens: int, released: Seq[int], chunk: int | None, keep: Seq[int] | None = None) -> int:
        """The most blocks a prompt of `num_tokens` holds at once while it is prefilled in chunks
        of at most `chunk` tokens (None: at once), its tables' leading `released` entries per
        group released. A chunk [s, e) in a windowed group needs the blocks from the one holding
        s - window + 1 to the one holding e - 1: at most blocks_for(chunk + window - 1) + 1; where
        `keep` names a first block the group never releases, it holds from there to the end too."""
        size = self._block_size
        whole = -(-num_tokens // size)
        keep = keep or [whole] * len(released)
        return sum(whole - r if chunk is None or w is None else
                   min(whole - r, max(-(-(chunk + w - 1) // size) + 1, whole - k))
                   for w, r, k in zip(self._windows, released, keep))

    def unpromised(self, promised: int) -> int:
        """The free blocks not promised to other sequences than one promised `promised`."""
        return self._pool.num_free - self.total + promised

    def settle(self, promised: int, need: int) -> int:
        """A sequence promised `promised` needs `need` blocks beyond those it holds: its promise
        now, as far as the free blocks not promised to others allow (0: it needs none, or has
        ended). It falls short only where the sequence released windowed blocks that others
        still hold (prefix hits), which freed nothing (`Policy._chunk` preempts it if that bites)."""
        new = max(0, min(need, self.unpromised(promised)))
        self.total += new - promised
        return new

    def check(self, promises: Seq[int]) -> None:
        """Raise `RuntimeError` unless `total` is the sequences' `promises` and free blocks back it."""
        if self.total != sum(promises) or self.total > self._pool.num_free:
            raise RuntimeError(f"{self.total} blocks promised: not the sequences' promises, or more than the "
                               f"{self._pool.num_free} free")
