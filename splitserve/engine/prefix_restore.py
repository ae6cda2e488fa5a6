"""A sequence's prefix blocks that the host tier holds (`host_kv_tier`), copied back into the
device cache before its prefix hit is taken, so `prefix_hit.find_hit` finds them as it finds any
cached block.

A restored block is a free block that turned into a cached, evictable one: the free count does
not change, so what admission asked of the free blocks (`BlockManager.blocks_to_admit`, which
never restores) still holds; where a group has a window, the longer hit may need fewer (admission
then asked too much). The device's own cached blocks of the prefix become the most
recently used before any block is taken for the copies, and only as many are restored as the
other free blocks allow, so a restore never evicts a block of the prefix it restores.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.host_kv_tier import HostEntry
from splitserve.engine.prefix_hash import block_key, num_reusable_blocks
from splitserve.engine.prefix_hit import PrefixHit
from splitserve.engine.sequence import Sequence


def restore_prefix(pool: BlockPool, seq: Sequence, windows: Seq[int | None], block_size: int, root: int) -> int:
    """Restore the host tier's blocks of `seq`'s chain (from `root`) up to the first block a full
    group has in neither tier; returns how many it copied."""
    tier = pool.host_tier
    if not tier.entries:
        return 0
    parent, on_device, wanted = root, [], []
    for i in range(num_reusable_blocks(seq.num_tokens, block_size)):
        key = block_key(parent, seq.token_ids, i, block_size)
        parent = hash(key)
        row, missed = [], False
        for group, window in enumerate(windows):
            block_id = pool.lookup(group, key, parent)
            if block_id is not None:
                on_device.append(block_id)
            elif tier.lookup(group, key, parent) is not None:
                row.append(HostEntry(key, group, parent))
            elif window is None:
                missed = True  # a windowed group's miss may be out of a hit's reach: later blocks still count
        if missed:
            break
        wanted += row
    protected = [block_id for block_id in on_device if pool.hashed[block_id].ref_count == 0]
    for block_id in protected:
        pool.evictable.move_to_end(block_id)
    wanted = wanted[:len(pool.fresh) + len(pool.evictable) - len(protected)]
    if wanted:  # take_fresh evicts only blocks of other prefixes (saved to the host tier)
        for block_id, entry in zip(tier.restore(wanted, pool.take_fresh), wanted):
            pool.revive(block_id, entry)
    return len(wanted)


def restored_hit(pool: BlockPool, seq: Sequence, windows: Seq[int | None], block_size: int, root: int,
                 find: Callable[[], PrefixHit], need: Callable[[PrefixHit], int]) -> PrefixHit:
    """The hit `find()` gives once the host tier's blocks of the prefix are back in the device
    cache; the hit without them where that `need`s fewer free blocks (a windowed group's longer hit
    may trade a block others hold for a restored one), so a mutation never asks more than the query
    before it said. The restore keeps the shorter hit's blocks."""
    hit = find()
    if not restore_prefix(pool, seq, windows, block_size, root):
        return hit
    restored = find()
    return restored if need(restored) <= need(hit) else hit
