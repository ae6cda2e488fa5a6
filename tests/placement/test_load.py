"""`load_of`: a worker's KV report. A decoding sequence holds no more of its free KV than the load's
`kv_tokens` says of its tokens rounded up to whole blocks, and as much at times, with full layer
groups or windowed ones; an import the report has room for (`import_tokens`) the worker takes."""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.policies import SchedulerLimits, make_policy
from splitserve.placement.hardware import HARDWARE_CLASSES
from splitserve.placement.load import load_of
from splitserve.placement.state import Role, WorkerState
from tests.engine.block_helpers import BS, make_seq, seq_range
from tests.engine.test_lora_residency import Slots, under


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


@pytest.mark.parametrize("windows", [(None,), (8,), (None, 8), (13, None), (None, 5, 5), (None, 30)])
def test_the_cls_places_an_import_only_where_the_token_worker_reserves_it(windows):
    """Random token workers (free blocks, decodes of random lengths and max_tokens) and imports: where
    the report's free KV covers `import_tokens`, `Policy.reserve_import` succeeds (with a windowed
    group it also asks room for the full groups' growth); it refuses no more than a few that fit
    (the report rounds to whole blocks per group)."""
    rng, refused_fitting = random.Random(0), 0
    for _ in range(500):
        blocks = BlockManager(rng.randint(10, 120), BS, windows=windows)
        policy = make_policy("token", blocks, SchedulerLimits())
        for i in range(rng.randint(0, 3)):
            decode = make_seq(f"d{i}", seq_range(100 * i, rng.randint(1, 40)), max_tokens=rng.randint(1, 60))
            try:
                policy.reserve_import(decode)
            except OutOfBlocksError:
                break
            if rng.random() < 0.7:  # the others still import
                policy.complete_import(decode.seq_id, 1)
        load = load_of(policy, blocks)
        seq = make_seq("s", seq_range(5000, rng.randint(1, 80)), max_tokens=rng.randint(1, 80))
        placed = load.free_kv_tokens >= load.import_tokens(seq.num_tokens + 1, seq.params.max_tokens)
        try:
            policy.reserve_import(seq)
        except OutOfBlocksError:
            assert not placed, (load, seq.num_tokens, seq.params.max_tokens)
        else:
            refused_fitting += not placed
    assert refused_fitting <= 10


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


def test_a_worker_reports_its_adapter_slots_as_its_scheduler_binds_them():
    """What the slots hold and how many no sequence is bound to (a claimed one is not idle), and the
    CLS's reading of it: an adapter held costs nothing, one an idle slot takes a swap, else a wait."""
    blocks = BlockManager(100, BS)
    policy = make_policy("mixed", blocks, SchedulerLimits())
    assert (load_of(policy, blocks).lora_slots, load_of(policy, blocks).lora_resident) == (0, ())  # no slots
    slots = Slots(2, ("a",))
    policy.adapters = slots.residency
    worker = WorkerState("w", Role.MIXED, HARDWARE_CLASSES["h100"], Role.MIXED, load_of(policy, blocks))
    assert (worker.load.lora_slots, worker.load.lora_resident, worker.load.lora_idle_slots) == (2, ("a",), 2)
    assert [worker.adapter_wait(a) for a in ("a", "b", None)] == [0, 1, 0]
    policy.add(under("b1", "b"), False)
    policy.add(under("a1", "a", at=1), False)
    policy.schedule()
    worker.load = load_of(policy, blocks)
    assert (worker.load.lora_resident, worker.load.lora_idle_slots) == (("a", "b"), 0)
    assert [worker.adapter_wait(a) for a in ("a", "b", "c")] == [0, 0, 2]
    policy.add(under("c1", "c", at=2), False)
    policy.schedule()  # c finds no slot and claims one (patience 0): it drains for c, idle for no one else
    for seq in list(policy.running):
        policy.finish(seq, "abort")
    assert load_of(policy, blocks).lora_idle_slots == 1


def test_a_host_tier_counts_in_what_the_prefix_index_keeps_of_a_worker():
    """A worker whose host tier holds what its cache evicted reports room for both, so the CLS's
    index keeps every block it holds, not only a cache's worth."""
    from splitserve.engine.host_kv_tier import HostKVTier
    from splitserve.placement.load import prefix_delta_of
    from splitserve.placement.prefix_index import PrefixIndex
    from tests.engine.test_host_kv_tier import Recorder, evict_all

    blocks = BlockManager(8, BS, host_tier=HostKVTier(32, 1, Recorder()))
    for i in range(4):  # 4 prompts of 6 full blocks: 24 cached, 16 of them pushed out to host slots
        seq = make_seq(f"p{i}", seq_range(100 * i, 6 * BS))
        blocks.allocate(seq)
        blocks.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        blocks.commit(seq)
        blocks.free(seq.seq_id)
    evict_all(blocks, "filler")
    delta = prefix_delta_of(blocks, snapshot=True)
    assert delta.num_blocks == 8 + 32 and len(delta.added) == 4 * 6
    index = PrefixIndex(1 << 20)
    index.apply("w", delta)
    assert index.num_entries("w") == 24
