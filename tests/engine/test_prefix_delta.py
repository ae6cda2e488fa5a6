"""The block manager's prefix delta (what a worker tells the cluster-level scheduler): the hashes
cached and evicted since the last take, net, under commit and eviction."""
from __future__ import annotations

import random

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.prefix_hash import prompt_block_hashes
from tests.engine.block_helpers import BS, cached, make_seq, seq_range


def hashes_of(tokens: list[int]) -> tuple[int, ...]:
    """The hashes of every full block of `tokens` (one more token, so the last block counts)."""
    return prompt_block_hashes(tokens + [0], BS, 1000)


def test_commit_adds_and_eviction_removes():
    bm = BlockManager(4, block_size=BS)
    a = seq_range(0, 2 * BS)
    cached(bm, "a", a)
    assert bm.take_prefix_delta() == (hashes_of(a), ())
    assert bm.take_prefix_delta() == ((), ())
    bm.free("a")  # still cached, evictable: no change
    assert bm.take_prefix_delta() == ((), ())
    b = seq_range(100, 3 * BS)  # 2 fresh blocks and one of a's: its tail, freed first
    cached(bm, "b", b)
    assert bm.take_prefix_delta() == (hashes_of(b), hashes_of(a)[1:])
    bm.check_integrity()


def test_the_delta_is_net():
    bm = BlockManager(2, block_size=BS)
    a, b = seq_range(0, BS), seq_range(50, BS)
    cached(bm, "a", a)
    bm.free("a")
    cached(bm, "x", seq_range(90, BS))  # a fresh block: a stays cached
    bm.free("x")
    bm.take_prefix_delta()
    cached(bm, "b", b)  # evicts a (the LRU evictable block)
    bm.free("b")
    cached(bm, "a2", a)  # evicts x, caches a again
    bm.check_integrity()
    added, removed = bm.take_prefix_delta()
    assert set(added) == set(hashes_of(b)) and set(removed) == set(hashes_of(seq_range(90, BS)))
    assert not set(added) & set(removed)


def test_a_snapshot_is_everything_cached_and_restarts_the_delta():
    bm = BlockManager(8, block_size=BS)
    a, b = seq_range(0, 2 * BS), seq_range(40, BS)
    cached(bm, "a", a)
    cached(bm, "b", b)
    assert bm.take_prefix_snapshot() == hashes_of(a) + hashes_of(b)  # oldest first
    assert bm.take_prefix_delta() == ((), ())


def test_with_prefix_caching_off_nothing_is_recorded():
    bm = BlockManager(2, block_size=BS, enable_prefix_caching=False)
    for i in range(4):
        cached(bm, f"s{i}", seq_range(10 * i, 2 * BS))
        bm.free(f"s{i}")
    assert bm.take_prefix_delta() == ((), ()) and bm.take_prefix_snapshot() == ()


def test_replaying_deltas_tracks_the_cache_under_churn():
    rng = random.Random(3)
    bm = BlockManager(12, block_size=BS)
    prefixes = [seq_range(100 * i, 2 * BS) for i in range(6)]
    mirror: set[int] = set()
    for step in range(300):
        tokens = rng.choice(prefixes) + seq_range(1000 + step, rng.randint(1, 2 * BS))
        seq = make_seq(f"s{step}", tokens)
        if bm.can_allocate(seq):
            bm.allocate(seq)
            seq.num_computed_tokens = seq.num_tokens
            bm.commit(seq)
        for owner in bm.owners():
            if rng.random() < 0.5:
                bm.free(owner)
        if rng.random() < 0.3:
            added, removed = bm.take_prefix_delta()
            assert not mirror & set(added) and set(removed) <= mirror
            mirror = (mirror - set(removed)) | set(added)
            assert mirror == set(bm.take_prefix_snapshot())
        bm.check_integrity()
