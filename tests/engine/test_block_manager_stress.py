"""Randomized stress test of `splitserve.engine.block_manager.BlockManager` (pure Python, CPU only).

The stress test simulates an engine on top of the block manager and also simulates the KV cache
itself: every slot written by a "step" (or an import transfer) records an id of the *whole token
prefix* up to and including that position (the KV of a token depends on every token before it).
After each operation, every computed position of every running sequence must read back its own
prefix id from its block table. That catches any wrong sharing, including sharing a block whose
tokens match but whose preceding context differs. With layer groups (`windows`), each group's
table is checked, a slot recording its group too (a block of one group never serves another);
in a windowed group the positions checked are those the sequence's next query can read (and a
handed-off sequence's from those its export reads on, `export_from`, all without: it keeps their
blocks). With `chunk`, prompts (handed-off ones naming `export_from` too) are admitted to be
prefilled chunk by chunk (`allocate(chunk_tokens=...)`): their tables grow before each chunk, out
of their promise, and the blocks they hold and are promised never pass the peak of a window and
a chunk. With `host_slots`, evicted cached blocks are kept in a host tier (its slots simulated
as the cache's) and restored on a hit: the same check reads what they restored.
"""

from __future__ import annotations

import pytest

from tests.engine.block_helpers import BS
from tests.engine.block_stress_sim import EngineSim


def _run_engine_sim(seed: int, num_ops: int, enable_prefix_caching: bool = True, num_blocks: int = 24,
                    block_size: int = BS, windows: tuple[int | None, ...] = (None,), chunk: int | None = None,
                    host_slots: int = 0, write_through: bool = False) -> dict:
    return EngineSim(seed, enable_prefix_caching, num_blocks, block_size, windows, chunk, host_slots,
                     write_through).run(num_ops)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_simulation_stress(seed):
    stats = _run_engine_sim(seed, 3000)
    # the simulation must actually exercise the interesting paths
    assert stats["hits"] > 20, stats
    assert stats["preempted"] > 5, stats
    assert stats["shared_seen"] > 20, stats
    assert stats["finished"] > 20, stats
    assert stats["imported"] > 5, stats


def test_engine_simulation_stress_no_prefix_caching():
    stats = _run_engine_sim(7, 1500, enable_prefix_caching=False)
    assert stats["hits"] == 0 and stats["shared_seen"] == 0
    assert stats["preempted"] > 5 and stats["finished"] > 20, stats


@pytest.mark.parametrize("seed,window", [(3, 5), (4, 8), (5, 13)])
def test_engine_simulation_stress_with_a_window(seed, window):
    """Released blocks go back to the pool and prefix hits take only a window's blocks: every
    position a sequence's next query reads still holds its own prefix's KV."""
    stats = _run_engine_sim(seed, 3000, windows=(window,))
    assert stats["released"] > 100 and stats["hits"] > 20 and stats["shared_seen"] > 20, stats
    assert stats["preempted"] > 5 and stats["imported"] > 5 and stats["import_hits"] > 2, stats


def test_engine_simulation_stress_with_a_window_no_prefix_caching():
    stats = _run_engine_sim(8, 1500, enable_prefix_caching=False, windows=(6,))
    assert stats["hits"] == 0 and stats["shared_seen"] == 0 and stats["released"] > 100, stats


@pytest.mark.parametrize("seed,windows", [(9, (None, 5)), (10, (None, 8, 8)), (11, (6, None))])
def test_engine_simulation_stress_with_layer_groups(seed, windows):
    """Full and windowed layer groups on one pool: each group's table holds its own KV, its
    windowed ones release, and a hit is one every group can serve."""
    stats = _run_engine_sim(seed, 3000, num_blocks=48, windows=windows)
    assert stats["released"] > 100 and stats["hits"] > 20 and stats["shared_seen"] > 20, stats
    assert stats["preempted"] > 5 and stats["imported"] > 5 and stats["import_hits"] > 2, stats


@pytest.mark.parametrize("seed,windows,chunk", [(12, (5,), 3), (13, (8,), 9), (14, (None, 6), 4), (15, (7, None), 16)])
def test_engine_simulation_stress_chunk_by_chunk(seed, windows, chunk):
    """Prompts of a windowed model prefilled chunk by chunk take their blocks as their chunks go,
    from their promise: a grow falls short only where released blocks stayed shared."""
    stats = _run_engine_sim(seed, 3000, num_blocks=24 * len(windows), windows=windows, chunk=chunk)
    assert stats["chunked"] > 50 and stats["released"] > 100 and stats["hits"] > 20, stats
    assert stats["preempted"] > 5 and stats["imported"] > 5 and stats["finished"] > 20, stats
    assert stats["handed_off_released"] > 20, stats
    assert stats["short"] <= stats["chunked"] // 10, stats


def test_engine_simulation_stress_chunk_by_chunk_no_prefix_caching():
    """Nothing is shared, so a promise never falls short."""
    stats = _run_engine_sim(16, 1500, enable_prefix_caching=False, windows=(6,), chunk=5)
    assert stats["chunked"] > 50 and stats["released"] > 100 and stats["short"] == 0, stats


@pytest.mark.parametrize("write_through", [False, True], ids=["write_back", "write_through"])
@pytest.mark.parametrize("seed,windows,chunk,host_slots", [(16, (None,), None, 40), (17, (None,), None, 3),
                                                            (18, (None, 5), None, 30), (19, (7, None), 4, 30),
                                                            (20, (6,), 3, 12)])
def test_engine_simulation_stress_with_a_host_tier(seed, windows, chunk, host_slots, write_through):
    """Cached blocks the pool evicts go to the host tier (written through as they are cached, the
    copy made as late as a side stream may) and come back on a hit: every position still reads its
    own prefix's KV (restored blocks included), the prefix delta counts both tiers, and a tier
    smaller than one eviction keeps the newest."""
    stats = _run_engine_sim(seed, 3000, num_blocks=24 * len(windows), windows=windows, chunk=chunk,
                            host_slots=host_slots, write_through=write_through)
    assert stats["restored"] > 30 and stats["saved"] > stats["restored"], stats
    assert stats["hits"] > 20 and stats["preempted"] > 5 and stats["import_hits"] > 2, stats
