"""A prefix-cache hit on one `BlockPool`: the longest cached prefix of a sequence's full blocks
that every layer group can serve. A full group needs every cached block of the prefix; a windowed
group only those from the first block a query right after the prefix can read (`first_needed`).
The last token is never covered, so a step always computes at least one token and produces logits.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.prefix_hash import block_key, num_reusable_blocks
from splitserve.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The first `blocks` blocks' KV is cached; per group, the first `released[g]` of them are out
    of reach and `hits[g]` hold the rest; `parent`: the chain's hash after them."""

    blocks: int
    released: list[int]
    hits: list[list[int]]
    parent: int


def first_needed(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block a query right after `num_tokens` computed tokens (at that position or later)
    can read."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def handed_off_hit(pool: BlockPool, seq: Sequence, windows: Seq[int | None], block_size: int, root: int,
                   keep: Seq[int]) -> PrefixHit:
    """A handed-off sequence's hit: taken whole (every group as a full one, as its export may read
    any block), then each windowed group releases what is out of reach but before block `keep[g]`."""
    hit = find_hit(pool, seq, [None] * len(windows), block_size, root)
    end = hit.blocks * block_size
    return released_to(hit, [min(first_needed(end, w, block_size), k) for w, k in zip(windows, keep)])


def released_to(hit: PrefixHit, released: Seq[int]) -> PrefixHit:
    """`hit` with each group's leading blocks out of reach up to `released` (or its own, if more)."""
    out = [max(r, first) for r, first in zip(hit.released, released)]
    hits = [blocks[max(0, o - r):] for blocks, r, o in zip(hit.hits, hit.released, out)]
    return PrefixHit(hit.blocks, out, hits, hit.parent)


def no_hit(num_groups: int, root: int) -> PrefixHit:
    return PrefixHit(0, [0] * num_groups, [[] for _ in range(num_groups)], root)


def find_hit(pool: BlockPool, seq: Sequence, windows: Seq[int | None], block_size: int, root: int) -> PrefixHit:
    """The hit of `seq`'s chain (from `root`) with groups of `windows`."""
    parent = root
    found = [[] for _ in windows]  # per group: the cached block of each leading block, or None
    gaps = [-1] * len(windows)     # per group: its last uncached block so far
    parents, best, lookup = [], 0, pool.lookup
    for i in range(num_reusable_blocks(seq.num_tokens, block_size)):
        key = block_key(parent, seq.token_ids, i, block_size)
        parent = hash(key)
        parents.append(parent)
        for group, blocks in enumerate(found):
            block_id = lookup(group, key, parent)
            blocks.append(block_id)
            if block_id is None:
                gaps[group] = i
        if any(gap >= 0 and window is None for gap, window in zip(gaps, windows)):
            break  # a full group misses a block: no longer prefix has it
        if all(first_needed((i + 1) * block_size, window, block_size) > gap for gap, window in zip(gaps, windows)):
            best = i + 1
    released = [first_needed(best * block_size, window, block_size) for window in windows]
    hits = [blocks[first:best] for blocks, first in zip(found, released)]
    return PrefixHit(best, released, hits, parents[best - 1] if best else root)
