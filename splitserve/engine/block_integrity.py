"""`BlockManager.check_integrity`'s walk over every block table and the pool: the invariants
`block_manager` and `block_pool` state, checked block by block (tests and a worker's soundness
check after a failure run it, never the engine step)."""
from __future__ import annotations

from splitserve.engine.block_pool import NULL_BLOCK, BlockPool
from splitserve.engine.held_blocks import HeldBlocks


def check_tables(pool: BlockPool, held_by: dict[str, HeldBlocks]) -> None:
    """Raise `RuntimeError` naming the first broken invariant of the sequences' tables (`held_by`)
    over `pool`."""
    refs, groups = [0] * pool.num_blocks, [set() for _ in range(pool.num_blocks)]
    for seq_id, held in held_by.items():
        if held.promised and not held.chunk:
            raise RuntimeError(f"{seq_id!r} is promised blocks but is not prefilled chunk by chunk")
        if len({len(table) for table in held.tables}) != 1:
            raise RuntimeError(f"block tables of {seq_id!r} cover different tokens")
        for group, (whole, released) in enumerate(zip(held.tables, held.released)):
            table = whole[released:]
            if any(b != NULL_BLOCK for b in whole[:released]) or (pool.reserved and NULL_BLOCK in table):
                raise RuntimeError(f"block table {group} of {seq_id!r} is not {released} released entries, "
                                   "then held blocks")
            if len(set(table)) != len(table):
                raise RuntimeError(f"block table {group} of {seq_id!r} holds a block twice: {whole}")
            if any(b in pool.hashed for b in whole[max(held.done, released):]):
                raise RuntimeError(f"block table {group} of {seq_id!r} has a hashed block past its hashed "
                                   f"prefix ({held.done})")
            for block_id in table:
                refs[block_id] += 1
                groups[block_id].add(group)
    free = [*pool.fresh, *pool.evictable]
    free_set = set(free)
    if len(free_set) != len(free):
        raise RuntimeError("a block is on the free lists twice")
    for block_id in free:
        if refs[block_id]:
            raise RuntimeError(f"block {block_id} is free but held by {refs[block_id]} tables")
    for block_id in pool.fresh:
        if block_id in pool.hashed:
            raise RuntimeError(f"block {block_id} is fresh but holds cached content")
    if pool.reserved and (NULL_BLOCK in free_set or NULL_BLOCK in pool.hashed):
        raise RuntimeError("NULL_BLOCK is on the free lists or cached")
    for block_id, count in enumerate(refs[pool.reserved:], pool.reserved):
        block = pool.hashed.get(block_id)
        if block is not None and (block.ref_count != count or not groups[block_id] <= {block.group}):
            raise RuntimeError(f"block {block_id}: ref_count {block.ref_count} of group {block.group} but held "
                               f"by {count} tables of groups {sorted(groups[block_id])}")
        if block is None and count > 1:
            raise RuntimeError(f"block {block_id} is shared but not a cached full block")
        if (count == 0) != (block_id in free_set):
            raise RuntimeError(f"block {block_id}: held by {count} tables, which disagrees with the free lists")
    for block_id in pool.evictable:
        if block_id not in pool.hashed:
            raise RuntimeError(f"block {block_id} is evictable but holds no cached content")
    for group, cached in enumerate(pool.cached):
        for h, block_id in cached.items():
            block = pool.hashed.get(block_id)
            if block is None or hash(block.key) != h or block.group != group:
                raise RuntimeError(f"prefix cache entry {h} of group {group} points at block {block_id}, "
                                   "which holds other content")
    pool.check_delta()
