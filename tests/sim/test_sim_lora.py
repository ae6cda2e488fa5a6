"""LoRA adapters in the simulator: the engine's own slot residency on every simulated worker (a
request waits for a slot its adapter can take, a swap costs `lora_swap_s`), and the real CLS's
LoRA-aware placement, which gathers each adapter's requests where a slot holds it."""
import random
import statistics

import pytest

from splitserve.bench.workload import RequestSpec
from splitserve.placement.state import AdapterOptions
from splitserve.sim.cluster import simulate
from tests.sim.test_sim_cluster import mixed, split


def under(index, arrival, adapter, prompt=100, output=3):
    return RequestSpec(index, arrival, prompt, output, adapter=adapter)


def test_a_swap_lengthens_the_iteration_that_admits_it_and_a_busy_slot_makes_the_next_adapter_wait():
    # one slot: a (0.1 s prefill + 0.05 s swap, then 2 decodes of 0.02 s) ends at 0.19; b, arriving
    # at 1.0, swaps in too; c under a arrives during b's prefill and waits for b to finish at 1.19
    requests = [under(0, 0.0, "a"), under(1, 1.0, "b"), under(2, 1.05, "a")]
    result = simulate(mixed(1, max_loras=1, lora_swap_s=0.05), requests)
    assert [r.ttft_s for r in result.records] == pytest.approx([0.15, 0.15, 1.19 + 0.15 - 1.05])
    assert [w.lora_swaps for w in result.workers] == [3]
    free = simulate(mixed(1, max_loras=2, lora_swap_s=0.05), requests)  # a stays in its slot: c swaps nothing
    assert [r.ttft_s for r in free.records] == pytest.approx([0.15, 0.15, 1.15 + 0.1 + 0.02 - 1.05])  # with b's decode
    assert [w.lora_swaps for w in free.workers] == [2]


def test_requests_under_adapters_need_slots():
    with pytest.raises(ValueError, match="set max_loras"):
        simulate(mixed(1), [under(0, 0.0, "a")])
    for bad in (dict(max_loras=65), dict(max_loras=-1), dict(lora_swap_s=float("nan"))):
        with pytest.raises(ValueError, match="max_loras|lora_swap_s"):
            mixed(1, **bad)


def poisson(rate, count=400, adapters=8, seed=0):
    rng, now, requests = random.Random(seed), 0.0, []
    for i in range(count):
        now += rng.expovariate(rate)
        requests.append(RequestSpec(i, now, rng.randint(100, 300), rng.randint(20, 80),
                                    adapter=f"a{rng.randrange(adapters)}"))
    return requests


def test_aware_placement_gathers_adapters_where_slots_hold_them():
    """8 adapters, 4 mixed workers of 2 slots: blind JSQ spreads each adapter over every worker,
    whose slots then cycle (swaps, and waits while every slot is busy); aware places each where a
    slot holds it, which roughly halves the swaps and the mean TTFT."""
    requests = poisson(8.0)
    aware, blind = (simulate(mixed(4, max_loras=2, lora_swap_s=0.005, adapters=AdapterOptions(aware=a)), requests)
                    for a in (True, False))
    assert all(r.status == 200 for r in (*aware.records, *blind.records))
    swaps = [sum(w.lora_swaps for w in result.workers) for result in (aware, blind)]
    assert swaps[0] < 0.6 * swaps[1]
    ttft = [statistics.mean(r.ttft_s for r in result.records) for result in (aware, blind)]
    assert ttft[0] < 0.5 * ttft[1]


def test_split_requests_bind_their_adapter_on_both_sides():
    """The prompt worker binds a slot for the prefill, the token worker one for the decode (an
    import that lands with no slot free waits, its KV in the prefix cache); all finish."""
    result = simulate(split(2, 2, max_loras=2, lora_swap_s=0.005, kv_budget_tokens=65536), poisson(4.0, 200))
    assert all(r.status == 200 and len(r.token_times_s) == r.output_tokens for r in result.records)
    assert all(w.lora_swaps > 0 for w in result.workers)
