"""The prefix cache's host tier (`splitserve.engine.host_kv_tier`, `prefix_restore`) through a
`BlockManager` (pure Python): evicted cached blocks are saved, a later hit restores them, the
prefix delta counts both tiers as one cache. The copies are recorded, not made (the KV itself:
test_block_manager_stress's host tier runs, and test_host_kv_blocks)."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.host_kv_tier import HostKVTier
from tests.engine.block_helpers import BS, cached, compute_all, make_seq, seq_range


class Recorder:
    """A `BlockMover` that records each copy and fence, and what each slot holds (the block id it saved)."""

    def __init__(self):
        self.saves, self.writes, self.loads, self.events, self.slot_of = [], [], [], [], {}

    def save(self, block_ids, slots):
        self.saves.append((list(block_ids), list(slots)))
        self.slot_of.update({slot: block for block, slot in zip(block_ids, slots)})

    def write(self, block_ids, slots):
        self.writes.append((list(block_ids), list(slots)))
        self.events.append("write")
        self.slot_of.update({slot: block for block, slot in zip(block_ids, slots)})

    def fence(self):
        self.events.append("fence")

    def load(self, slots, block_ids):
        self.loads.append((list(slots), list(block_ids)))
        self.events.append("load")


def manager(num_blocks: int, slots: int, write_through: bool = False) -> tuple[BlockManager, HostKVTier, Recorder]:
    mover = Recorder()
    tier = HostKVTier(slots, 1, mover, write_through)
    return BlockManager(num_blocks, block_size=BS, host_tier=tier), tier, mover


def evict_all(bm: BlockManager, tag: str) -> None:
    """Take every free block for an unrelated sequence, then free it: cached blocks are evicted."""
    filler = make_seq(tag, seq_range(10_000, bm.num_free_blocks * BS))
    bm.allocate(filler)
    bm.free(tag)


def test_an_evicted_prefix_is_saved_and_restored_on_a_hit():
    bm, tier, mover = manager(8, 8)
    prefix = seq_range(0, 3 * BS)
    cached(bm, "a", prefix + [1])
    a_blocks = bm.block_table("a")[:3]
    bm.free("a")
    evict_all(bm, "filler")
    assert sorted(b for ids, _ in mover.saves for b in ids) == sorted(a_blocks)  # only the hashed ones
    assert tier.saved_blocks == 3 and len(tier.entries) == 3

    b = make_seq("b", prefix + [2, 3])
    free = bm.num_free_blocks
    assert bm.blocks_to_admit(b) == bm.blocks_for(b.num_tokens)  # the query copies nothing
    assert not mover.loads
    bm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 3 * BS
    (slots, ids), = mover.loads
    assert [mover.slot_of[s] for s in slots] == a_blocks  # each slot back, in prefix order
    assert bm.block_table("b")[:3] == ids
    assert bm.num_free_blocks == free - bm.blocks_for(b.num_tokens)
    assert tier.restored_blocks == 3 and not tier.entries  # moved, not copied: one tier holds a block
    bm.check_integrity()


def test_a_restore_never_evicts_the_prefix_it_restores():
    """The prefix's own cached device blocks become the most recently used before blocks are taken
    for the copies; only as many are restored as other free blocks allow."""
    bm, tier, mover = manager(6, 8)
    prefix = seq_range(0, 4 * BS)
    cached(bm, "a", prefix + [1])
    bm.free("a")  # the prefix's 4 blocks cached (the last one least recently used), 2 fresh
    other = cached(bm, "o", seq_range(500, 2 * BS + 1))  # takes both fresh ones and evicts the prefix's last
    bm.free("o")
    assert len(tier.entries) == 1
    b = make_seq("b", prefix + [2])
    bm.allocate(b)
    assert b.num_computed_tokens == 4 * BS  # three on the device, one restored
    assert tier.restored_blocks == 1
    assert other.seq_id not in bm.owners()
    bm.check_integrity()


def test_the_host_tier_drops_its_least_recently_saved_and_the_delta_says_so():
    bm, tier, mover = manager(4, 2)
    bm.take_prefix_snapshot()
    first, second = seq_range(0, BS), seq_range(100, BS)
    cached(bm, "a", first + [1])
    bm.free("a")
    cached(bm, "b", second + [1])
    bm.free("b")
    cached_now, evicted = bm.take_prefix_delta()
    assert len(cached_now) == 2 and not evicted
    evict_all(bm, "f1")  # both to the host tier: still cached, no delta
    assert bm.take_prefix_delta() == ((), ())
    assert len(bm.take_prefix_snapshot()) == 2  # the snapshot names the host tier's too
    cached(bm, "c", seq_range(200, 3 * BS) + [1])
    bm.free("c")
    evict_all(bm, "f2")  # c's 3 blocks evicted into 2 slots: its oldest and both of a's and b's go
    new, evicted = bm.take_prefix_delta()
    assert len(evicted) == 2 and len(new) == 2 and len(tier.entries) == 2  # c's first cached and dropped: no news
    assert set(evicted) == set(cached_now)
    a = make_seq("a2", first + [5])
    bm.allocate(a)
    assert a.num_computed_tokens == 0  # dropped: computed again
    bm.check_integrity()


def test_a_block_computed_again_drops_its_host_copy():
    """A sequence that skips the prefix cache computes a block the host tier holds: the device
    copy is the cached one, the host's slot is free again, and the delta records nothing."""
    bm, tier, mover = manager(4, 4)
    prefix = seq_range(0, 2 * BS)
    cached(bm, "a", prefix + [1])
    bm.free("a")
    evict_all(bm, "f")
    assert len(tier.entries) == 2
    bm.take_prefix_delta()
    again = make_seq("again", prefix + [1])
    bm.allocate(again, use_prefix_cache=False)
    compute_all(bm, again)
    assert not tier.entries and len(tier.free) == 4
    assert bm.take_prefix_delta() == ((), ())
    bm.check_integrity()


def test_a_tier_smaller_than_one_eviction_keeps_the_newest():
    bm, tier, mover = manager(6, 2)
    cached(bm, "a", seq_range(0, 5 * BS) + [1])
    table = bm.block_table("a")
    bm.free("a")  # the tail's blocks are freed first, so the first blocks are the most recently used
    evict_all(bm, "f")  # all 5 evicted at once
    (ids, slots), = mover.saves
    assert ids == [table[1], table[0]] and len(tier.entries) == 2
    bm.check_integrity()


def test_a_tier_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        HostKVTier(0, 1, Recorder())


def test_write_through_copies_a_block_once_cached_and_an_eviction_copies_nothing():
    bm, tier, mover = manager(8, 8, write_through=True)
    prefix = seq_range(0, 3 * BS)
    cached(bm, "a", prefix + [1])
    a_blocks = bm.block_table("a")[:3]
    assert not mover.writes  # queued until the step's flush
    tier.flush()
    (ids, slots), = mover.writes
    assert ids == a_blocks and tier.saved_blocks == 3
    bm.free("a")
    evict_all(bm, "filler")
    assert not mover.saves and mover.events == ["write", "fence"]  # the blocks are reused after their write
    b = make_seq("b", prefix + [2, 3])
    bm.allocate(b)
    assert b.num_computed_tokens == 3 * BS and tier.restored_blocks == 3
    (loaded, _), = mover.loads
    assert [mover.slot_of[s] for s in loaded] == a_blocks
    assert len(tier.entries) == 3  # still held: both tiers have the prefix now
    compute_all(bm, b)
    tier.flush()
    assert len(mover.writes) == 1  # the restored blocks are not written again
    bm.check_integrity()


def test_write_through_keeps_the_most_recently_computed_and_the_delta_counts_the_device():
    """The host tier pushes out its least recently used; a content the device still caches is no
    news to the CLS, one neither tier holds is evicted."""
    bm, tier, mover = manager(8, 2, write_through=True)
    bm.take_prefix_snapshot()
    a = cached(bm, "a", seq_range(0, 3 * BS) + [1])
    table = bm.block_table(a.seq_id)
    tier.flush()
    assert len(tier.entries) == 2 and mover.writes == [(table[1:3], [1, 0])]
    new, evicted = bm.take_prefix_delta()
    assert len(new) == 3 and not evicted  # a's first block is on the device only
    bm.free(a.seq_id)  # the tail first: its last block is the least recently used
    evict_all(bm, "f")  # the first block is saved in place of the last, which leaves both tiers
    (saved, _), = mover.saves
    assert saved == table[:1] and len(tier.entries) == 2
    new, evicted = bm.take_prefix_delta()
    assert not new and len(evicted) == 1
    b = make_seq("b", seq_range(0, 3 * BS) + [2])
    bm.allocate(b)
    assert b.num_computed_tokens == 2 * BS
    bm.check_integrity()


def test_write_through_never_writes_a_block_reused_before_the_flush():
    """A queued write whose block is evicted is issued before the eviction hands the block out."""
    bm, tier, mover = manager(2, 4, write_through=True)
    a = cached(bm, "a", seq_range(0, 2 * BS))
    blocks = bm.block_table(a.seq_id)
    bm.free(a.seq_id)
    evict_all(bm, "f")
    assert mover.events == ["write", "fence"] and not mover.saves
    assert [ids for ids, _ in mover.writes] == [blocks]

