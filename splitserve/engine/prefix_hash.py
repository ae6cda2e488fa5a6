"""Prefix-cache keys of full KV blocks, one definition for the block manager (which caches blocks
by them) and the ingress (which names a prompt's blocks to the cluster-level scheduler).

A block's key is (its parent's hash, its token ids), so its hash names its whole prefix. Only
full blocks are keyed, and a lookup never covers a prompt's last token (a step must compute at
least one token, to produce logits).

Cross-process invariant: the ingress, the CLS and every worker compute the same hashes, since the
hash of a tuple of ints depends on the ints alone (it is not salted by PYTHONHASHSEED, unlike str
and bytes; all processes run the same 64-bit CPython). The first block's parent is `ROOT`, an int:
before Python 3.12, hash(None) is None's address, which differs between processes.
"""
from __future__ import annotations

from collections.abc import Sequence

ROOT = 0  # the parent hash of a prompt's first block
LONG_ROPE_ROOT = 1  # ... of a sequence a LongRoPE model turns long (the same tokens' KV differs from a short one's)

def block_key(parent: int, token_ids: Sequence[int], index: int, block_size: int) -> tuple[int, tuple[int, ...]]:
    """The cache key of full block `index` of `token_ids`, whose parent block hashes to `parent`."""
    return parent, tuple(token_ids[index * block_size:(index + 1) * block_size])


def num_reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks a prompt of `num_tokens` may take from the cache (never its last token)."""
    return (num_tokens - 1) // block_size


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> tuple[int, ...]:
    """The hashes of the blocks a prefix-cache lookup of `token_ids` tries, in order (at most
    `max_blocks`: the first ones, themselves a chain)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    hashes, parent = [], ROOT
    for index in range(min(num_reusable_blocks(len(token_ids), block_size), max_blocks)):
        parent = hash(block_key(parent, token_ids, index, block_size))
        hashes.append(parent)
    return tuple(hashes)
