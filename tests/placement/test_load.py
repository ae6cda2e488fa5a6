"""`load_of`: a worker's KV report. A decoding sequence holds no more of its free KV than the load's
`kv_tokens` says of its tokens rounded up to whole blocks, and as much at times, with full layer
groups or windowed ones."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import SchedulerLimits, make_policy
from splitserve.placement.load import load_of
from tests.engine.block_helpers import BS, make_seq


@pytest.mark.parametrize("windows", [(None,), (8,), (None, 8), (13, None), (None, 5, 5)])
def test_a_decoding_sequence_holds_what_the_load_says(windows):
    blocks = BlockManager(400, BS, windows=windows)
    policy = make_policy("token", blocks, SchedulerLimits())
    load = load_of(policy, blocks)
    assert (load.kv_groups, load.kv_full_groups) == (len(windows), windows.count(None))
    seq, attained = make_seq("s", [1]), 0
    blocks.allocate(seq)
    for n in range(1, 120):
        blocks.grow(seq, n + 1)  # the next token's slot, as a decode step takes it
        seq.num_computed_tokens = n
        blocks.commit(seq)
        held = -(-blocks.num_held_blocks("s") * BS // len(windows))  # in free_kv_tokens' unit
        bound = load.kv_tokens(blocks.blocks_for(n + 1) * BS)
        assert held <= bound, (n, held, bound)
        attained += held == bound
        seq.append_token(1)
    assert attained > 10
    if windows.count(None) == 0:
        assert load.kv_tokens(120) == load.kv_window_tokens < 120 // 2  # a window's, however long it runs
    elif len(windows) > windows.count(None):
        assert load.kv_tokens(120) < 120


def test_a_full_attention_worker_counts_every_token():
    blocks = BlockManager(64, BS)
    load = load_of(make_policy("token", blocks, SchedulerLimits()), blocks)
    assert load.kv_window_tokens == 0 and load.kv_tokens(1000) == 1000


def test_preempted_sequences_waiting_are_reported():
    blocks = BlockManager(64, BS)
    policy = make_policy("token", blocks, SchedulerLimits())
    seq = make_seq("s", list(range(9)))
    policy.reserve_import(seq)
    policy.complete_import("s", 1)
    policy.add(make_seq("fresh", [1, 2, 3]))
    assert (load_of(policy, blocks).num_waiting, load_of(policy, blocks).num_preempted) == (1, 0)
    policy.preempt(seq)
    assert (load_of(policy, blocks).num_waiting, load_of(policy, blocks).num_preempted) == (2, 1)
