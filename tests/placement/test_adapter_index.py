"""The CLS's adapter-slot index stays what the workers' states say through random reports,
placements under adapters, joins and removals (`AdapterIndex.check_integrity` rebuilds it)."""
import dataclasses
import random

from splitserve.placement import ClusterState, PlacementRequest, Role, WorkerLoad
from splitserve.placement.adapter_index import AdapterIndex
from tests.placement.placement_helpers import H100, load

ADAPTERS = tuple("abcdef")


def random_load(rng: random.Random) -> WorkerLoad:
    slots = rng.choice([0, 1, 2, 4])
    resident = tuple(rng.sample(ADAPTERS, rng.randint(0, slots)))
    return dataclasses.replace(load(pending=rng.randint(0, 2000), decode=rng.randint(0, 5000)), lora_slots=slots,
                               lora_resident=resident, lora_idle_slots=rng.randint(0, slots))


def test_random_churn_keeps_the_index_what_the_workers_say():
    rng = random.Random(0)
    state, joined = ClusterState("splitwise"), 0
    for step in range(3000):
        action = rng.random()
        if action < 0.05 or not state.workers:
            state.add_worker(f"w{joined:03d}", rng.choice(list(Role)), H100, random_load(rng))
            joined += 1
        elif action < 0.08:
            state.remove_worker(rng.choice(sorted(state.workers)))
        elif action < 0.5:
            state.report(rng.choice(sorted(state.workers)), random_load(rng), step)
        else:
            state.place(PlacementRequest(f"r{step}", rng.randint(1, 500), rng.randint(1, 50),
                                         lora=rng.choice([None, *ADAPTERS])), step)
        state.check_integrity()
    assert any(w.placed_adapters for w in state.workers.values()) and state.adapter_index.idle


def test_a_worker_holds_what_it_reports_and_what_was_placed_on_it_since():
    state = ClusterState("jsq")
    state.add_worker("m0", Role.MIXED, H100, dataclasses.replace(load(), lora_slots=2, lora_resident=("a",),
                                                                 lora_idle_slots=1))
    index: AdapterIndex = state.adapter_index
    assert set(index.holders("a")) == {"m0"} and index.idle == {"m0"}
    state.place(PlacementRequest("r", 10, 2, lora="b"), 0.0)
    assert set(index.holders("b")) == {"m0"} and index.idle == set()  # b took the idle slot
    state.report("m0", dataclasses.replace(load(), lora_slots=2, lora_resident=("b", "c")), 1.0)
    assert not index.holders("a") and set(index.holders("c")) == {"m0"}
    state.remove_worker("m0")
    assert not index.holders("b") and index.idle == set()
