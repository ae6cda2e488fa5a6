"""LoRA-aware placement on hand-computed states: a worker whose slots do not hold a request's adapter
counts as more loaded by a share of the overflow threshold (a swap into an idle slot, or a wait
for one), within the blind rules' eligibility; what the CLS placed since a report counts as held;
with adapter-aware placement off, or for the base model, the blind decisions."""
import dataclasses

import pytest

from splitserve.placement import ClusterState, PlacementRequest, PlacementThresholds, Role
from splitserve.placement.state import AdapterOptions, WorkerLoad
from tests.placement.placement_helpers import H100, load

P, T, M = Role.PROMPT, Role.TOKEN, Role.MIXED
THRESHOLDS = PlacementThresholds(mixed_prompt_tokens=1000, mixed_decode_tokens=10000)
SHARES = AdapterOptions(swap_share=0.1, wait_share=0.5)  # 100 / 500 prompt tokens, 1000 / 5000 decode tokens


def slots(worker_load: WorkerLoad, resident: tuple[str, ...] = (), idle: int = 0, num_slots: int = 2) -> WorkerLoad:
    return dataclasses.replace(worker_load, lora_slots=num_slots, lora_resident=resident, lora_idle_slots=idle)


def state_of(policy: str, workers: dict, adapters: AdapterOptions = SHARES) -> ClusterState:
    """workers: id -> (pool, load), H100s, reported at time 1."""
    state = ClusterState(policy, THRESHOLDS, adapters=adapters)
    for worker_id, (pool, worker_load) in workers.items():
        state.add_worker(worker_id, pool, H100)
        state.report(worker_id, worker_load, 1.0)
    return state


def place(state: ClusterState, lora: str | None, request_id: str = "r", prompt: int = 100):
    placement, moves = state.place(PlacementRequest(request_id, prompt, 10, lora=lora), 2.0)
    assert moves == []
    state.check_integrity()
    return placement.prompt_worker, placement.token_worker


@pytest.mark.parametrize("policy", ["jsq", "splitwise"])
def test_a_pair_goes_where_the_adapter_is_held_unless_the_queues_differ_by_more_than_its_cost(policy):
    workers = {"p0": (P, slots(load(pending=0), ("b",), idle=1)), "p1": (P, slots(load(pending=90), ("a",))),
               "t0": (T, slots(load(decode=0), ("b",))), "t1": (T, slots(load(decode=4000), ("a",)))}
    # p0 swaps (100) > p1's 90 more queued; t0 waits (5000) > t1's 4000
    assert place(state_of(policy, workers), "a") == ("p1", "t1")
    assert place(state_of(policy, workers), "b") == ("p0", "t0")
    assert place(state_of(policy, workers), None) == ("p0", "t0")  # the base model: blind
    assert place(state_of(policy, workers, AdapterOptions(aware=False)), "a") == ("p0", "t0")
    workers["p1"] = (P, slots(load(pending=110), ("a",)))
    workers["t1"] = (T, slots(load(decode=5100), ("a",)))
    assert place(state_of(policy, workers), "a") == ("p0", "t0")


@pytest.mark.parametrize("policy", ["jsq", "splitwise"])
def test_a_worker_with_an_idle_slot_beats_one_whose_slots_are_all_busy(policy):
    workers = {"m0": (M, slots(load(pending=300), ("b", "c"))), "m1": (M, slots(load(pending=500), ("b", "c"), 1))}
    # combined load: m0 0.3 + wait 0.5 > m1 0.5 + swap 0.1
    assert place(state_of(policy, workers), "a") == ("m1", "m1")


def test_what_was_placed_since_a_report_counts_as_held_until_the_next_report():
    """Requests under two new adapters: the first takes m0's idle slot, so the second would wait
    there, and goes to m1; the first's adapter then stays with m0."""
    state = state_of("jsq", {"m0": (M, slots(load(), idle=1)), "m1": (M, slots(load(pending=20), idle=1))})
    assert place(state, "a", "r1") == ("m0", "m0")
    assert state.workers["m0"].placed_adapters == ("a",)
    assert place(state, "b", "r2") == ("m1", "m1")
    assert place(state, "a", "r3", prompt=10) == ("m0", "m0")  # m0 has the more queued now, but holds "a"
    assert state.snapshot()["workers"]["m0"]["placed_adapters"] == ["a"]
    assert state.adapter_placements == [1, 2, 0]  # r3 where its adapter was held; r1, r2 where a slot was idle
    place(state, "c", "r4")
    assert state.adapter_placements == [1, 2, 1]  # c waits wherever it goes
    state.report("m0", slots(load(pending=210), ("a",), 0), 3.0)
    assert state.workers["m0"].placed_adapters == ()


def test_held_adapters_do_not_admit_a_worker_past_backpressure():
    workers = {"p0": (P, slots(load(pending=16384), ("a",))), "p1": (P, slots(load(pending=3000), ("b",))),
               "t0": (T, slots(load(), ("a",)))}
    assert place(state_of("jsq", workers), "a") == ("p1", "t0")
