"""Prefix-cache keys of full KV blocks, one definition for the block manager (which caches blocks
by them) and the ingress (which names a prompt's blocks to the cluster-level scheduler).

A block's key is (its parent's hash, its token ids), so its hash names its whole prefix. Only
full blocks are keyed, and a lookup never covers a prompt's last token (a step must compute at
least one token, to produce logits).

Cross-process invariant: the ingress, the CLS and every worker compute the same hashes, since the
hash of a tuple of ints depends on the ints alone (it is not salted by PYTHONHASHSEED, unlike str
and bytes; all processes run the same 64-bit CPython). The first block's parent is `ROOT`, an int:
before Python 3.12, hash(None) is None's address, which differs between processes. A LoRA
adapter's KV differs from the base model's for the same tokens: its chains start from a root of
its own (`adapter_root`, from its identity through a fixed digest, not str's salted hash; the
identity of one loaded at start is its name, `lora_adapter`). A request's `cache_salt` (vLLM's)
joins its root the same way, so only requests sending the same salt share its blocks.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.sequence import Sequence as EngineSequence

ROOT = 0  # the parent hash of a prompt's first block
LONG_ROPE_ROOT = 1  # ... of a sequence a LongRoPE model turns long (the same tokens' KV differs from a short one's)
SALT_TAG = 2  # joined with a cache salt's digest: no salt names the root an adapter of the same text names

def block_key(parent: int, token_ids: Sequence[int], index: int, block_size: int) -> tuple[int, tuple[int, ...]]:
    """The cache key of full block `index` of `token_ids`, whose parent block hashes to `parent`."""
    return parent, tuple(token_ids[index * block_size:(index + 1) * block_size])


def num_reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks a prompt of `num_tokens` may take from the cache (never its last token)."""
    return (num_tokens - 1) // block_size


def adapter_root(lora: str) -> int:
    """The same int in every process for one adapter identity (or cache salt)."""
    return int.from_bytes(hashlib.blake2b(lora.encode(), digest_size=8).digest(), "little")


def chain_root(num_tokens: int, long_rope_from: int | None, lora: str | None = None, salt: str | None = None) -> int:
    """The root a sequence of `num_tokens` chains its blocks from: LONG_ROPE_ROOT where a LongRoPE
    model (trained context `long_rope_from`) turns it long, else ROOT; under a LoRA adapter, that
    root joined with the adapter's; with a cache salt, joined with the salt's."""
    root = LONG_ROPE_ROOT if long_rope_from is not None and num_tokens > long_rope_from else ROOT
    if lora is not None:
        root = hash((root, adapter_root(lora)))
    return root if salt is None else hash((root, SALT_TAG, adapter_root(salt)))


def sequence_root(long_from: int | None) -> Callable[[EngineSequence], int]:
    """A block manager's `root_of` for a model: with LongRoPE, a sequence of more than `long_from`
    tokens (whose KV turns long) chains from LONG_ROPE_ROOT; one under a LoRA adapter from that root
    joined with the adapter's identity, and its cache salt's, as the ingress names them (`chain_root`)."""
    return lambda seq: chain_root(seq.num_tokens, long_from, seq.adapter_identity, seq.params.cache_salt)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int, long_rope_from: int | None = None,
                        lora: str | None = None, salt: str | None = None) -> tuple[int, ...]:
    """The hashes of the blocks a prefix-cache lookup of `token_ids` (under adapter `lora`, with
    cache salt `salt`) tries, in order (at most `max_blocks`: the first ones, themselves a chain)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    hashes, parent = [], chain_root(len(token_ids), long_rope_from, lora, salt)
    for index in range(min(num_reusable_blocks(len(token_ids), block_size), max_blocks)):
        parent = hash(block_key(parent, token_ids, index, block_size))
        hashes.append(parent)
    return tuple(hashes)


@dataclass(frozen=True)
class PrefixNaming:
    """How a request names its prompt's blocks to the cluster-level scheduler, as the workers'
    block managers name them: the engines' block size (0: it names none) and a LongRoPE model's
    trained context (`ModelConfig.long_rope_from`)."""

    block_size: int = 0
    long_rope_from: int | None = None
    lora_identities: tuple[tuple[str, str], ...] = ()  # adapters loaded at run time: (name, identity)

    def hashes(self, token_ids: Sequence[int], max_blocks: int, lora: str | None = None,
               salt: str | None = None) -> tuple[int, ...]:
        """Under adapter `lora` (its name), its blocks as named from its identity (by default its
        name); with cache salt `salt`, as named from it too."""
        if not self.block_size:
            return ()
        identity = dict(self.lora_identities).get(lora, lora) if lora is not None else None
        return prompt_block_hashes(token_ids, self.block_size, max_blocks, self.long_rope_from, identity, salt)
