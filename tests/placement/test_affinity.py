"""The prefix- and LoRA-aware searches (placement/affinity.py) pick what a brute-force search over
every eligible worker picks: the least queue less the saved work, plus the adapter's cost, ties to
the lowest id."""
import dataclasses
import math
import random

import pytest

from splitserve.placement import Role
from splitserve.placement.base import (
    can_decode,
    can_prompt,
    can_run_whole,
    combined_load,
    least_prompt_queue,
    least_token_queue,
)
from splitserve.placement.affinity import Affinity, least_loaded_affine, prefer_affine_prompt, prefer_affine_token
from splitserve.placement.state import AdapterOptions, PlacementRequest, PrefixOptions, WorkerLoad
from tests.placement.placement_helpers import A100, H100, LIMITS, cluster, load, request

ADAPTERS = ("a", "b", "c", "d")


def with_slots(worker_load: WorkerLoad, slots: int, resident: tuple[str, ...], idle: int) -> WorkerLoad:
    return dataclasses.replace(worker_load, lora_slots=slots, lora_resident=resident, lora_idle_slots=idle)


def random_slots(rng: random.Random, worker_load: WorkerLoad) -> WorkerLoad:
    slots = rng.choice([0, 1, 2, 3])
    resident = tuple(rng.sample(ADAPTERS, rng.randint(0, slots)))
    return with_slots(worker_load, slots, resident, rng.randint(0, slots))

def random_state(rng: random.Random):
    def specs(prefix):
        return [(f"{prefix}{i:02d}", rng.choice([H100, A100]),
                 load(pending=rng.choice([0, 100, rng.randint(0, 3500)]), decode=rng.choice([0, rng.randint(0, 25000)]),
                      free=rng.randint(0, 3000), total=rng.choice([0, 3000])))
                for i in range(rng.randint(0, 6))]
    state = cluster("jsq", prompt=specs("p"), token=specs("t"), mixed=specs("m"), thresholds=LIMITS)
    for worker in state.workers.values():
        worker.placed_prompt_tokens, worker.placed_decode_tokens = rng.randint(0, 300), rng.randint(0, 300)
        worker.load = random_slots(rng, worker.load)
        worker.placed_adapters = tuple(rng.sample(ADAPTERS, rng.randint(0, 1)))
        state.adapter_index.update(worker)
    cached = {w: rng.choice([16, 64, 1024, 2400]) for w in state.workers if rng.random() < 0.4}
    options = PrefixOptions(prefill_saved_weight=rng.choice([0.0, 1.0, 2.5]),
                            transfer_saved_weight=rng.choice([0, 1.0]))
    adapters = AdapterOptions(swap_share=rng.choice([0.0, 0.05, 0.3]), wait_share=rng.choice([0.5, 1.0, 3.0]))
    return state, Affinity(cached, options, LIMITS, rng.choice([None, *ADAPTERS]), adapters)


def reference(workers, eligible, score):
    candidates = [w for w in workers if eligible(w)]
    return min(candidates, key=lambda w: (score(w), w.worker_id), default=None)


@pytest.mark.parametrize("seed", range(200))
def test_the_searches_match_a_brute_force_search(seed):
    rng = random.Random(seed)
    state, saved = random_state(rng)
    req = request(rng.randint(1, 2500), rng.randint(0, 100))
    exclude = frozenset(w for w in state.workers if rng.random() < 0.2)
    cap = rng.choice([math.inf, 1000.0, 150.0])
    prompts, tokens = state.members(Role.PROMPT), state.members(Role.TOKEN)

    blind = least_prompt_queue(prompts, LIMITS, exclude)
    if blind is None or blind.prompt_queue() <= cap:  # what callers guarantee
        assert prefer_affine_prompt(state, blind, saved, exclude, cap) is reference(
            prompts, lambda w: can_prompt(w, LIMITS, exclude) and w.prompt_queue() - saved.prefix_saving(w) <= cap,
            lambda w: w.prompt_queue() - saved.prefill(w))
    blind = least_token_queue(tokens, LIMITS, req, exclude)
    if blind is None or blind.token_queue() <= cap * 8:
        assert prefer_affine_token(state, blind, saved, req, exclude, cap * 8) is reference(
            tokens, lambda w: can_decode(w, LIMITS, req, exclude) and w.token_queue() <= cap * 8,
            lambda w: w.token_queue() - saved.transfer(w))
    for pool in Role:
        for decode_only in (False, True):
            prompt_cap, token_cap = (math.inf, cap * 8) if decode_only else (cap, math.inf)
            chosen = least_loaded_affine(state, pool, req, exclude, saved, decode_only, prompt_cap, token_cap)
            saving = {"saved_token": saved.transfer} if decode_only else {"saved_prompt": saved.prefill}

            def score(w):
                return combined_load(w, LIMITS, **{k: f(w) for k, f in saving.items()})
            expected = reference(state.members(pool), lambda w: can_run_whole(w, LIMITS, req, exclude)
                                 and w.prompt_queue() <= prompt_cap and w.token_queue() <= token_cap, score)
            if chosen is None or expected is None:
                assert chosen is expected
            else:  # the blind scan multiplies by 1 / threshold: equal loads may differ in the last bit
                assert score(chosen) == pytest.approx(score(expected), rel=1e-12, abs=1e-12)


def test_saved_work_is_in_each_queues_units():
    state = cluster("jsq", prompt=[("pa", A100, load()), ("ph", H100, load())], token=[("t", A100, load())])
    saved = Affinity({"pa": 900, "ph": 900, "t": 900}, PrefixOptions(prefill_saved_weight=1.0,
                                                                      transfer_saved_weight=0.5), LIMITS)
    pa, ph, t = (state.workers[w] for w in ("pa", "ph", "t"))
    assert saved.prefill(ph) == 900 and saved.prefill(pa) == pytest.approx(900 / 0.45)  # as its queue counts
    assert saved.transfer(t) == 450  # the transfer is the network's, not the worker's speed
    assert saved.prefill(state.workers["t"]) == pytest.approx(2000)
    assert saved.candidates(state, Role.PROMPT, None) == [pa, ph]


def test_an_adapter_costs_a_share_of_each_threshold_where_no_slot_holds_it():
    held, idle, busy = (with_slots(load(), 2, ("a", "b"), 0), with_slots(load(), 2, ("b",), 1),
                        with_slots(load(), 2, ("b", "c"), 0))
    state = cluster("jsq", prompt=[("p0", H100, held), ("p1", H100, idle), ("p2", H100, busy), ("p3", H100, load())])
    affinity = Affinity({"p0": 160}, PrefixOptions(), LIMITS, "a", AdapterOptions(swap_share=0.1, wait_share=0.5))
    p0, p1, p2, p3 = state.members(Role.PROMPT)
    assert [p.adapter_wait("a") for p in (p0, p1, p2, p3)] == [0, 1, 2, 1]  # p3 reports no slots yet: empty ones
    assert affinity.prefill(p0) == 160 and affinity.prefill(p1) == -100 and affinity.prefill(p2) == -500
    assert affinity.transfer(p1) == -800 and affinity.transfer(p2) == -4000  # of mixed_decode_tokens
    # the holders (p0), and where the blind choice waits, the idle ones (p3: no slots reported yet)
    assert affinity.candidates(state, Role.PROMPT, p0) == [p0] == affinity.candidates(state, Role.PROMPT, p1)
    assert sorted(affinity.candidates(state, Role.PROMPT, p2), key=lambda w: w.worker_id) == [p0, p1, p3]
    p1.placed_adapters = ("c",)  # placed since its report: its idle slot is taken, "c" is held there
    assert p1.adapter_wait("a") == 2 and p1.adapter_wait("c") == 0 and p1.adapter_wait(None) == 0


@pytest.mark.parametrize("bad", [dict(lora_slots=65), dict(lora_slots=1, lora_idle_slots=2),
                                 dict(lora_slots=1, lora_resident=("a", "b")), dict(lora_slots=1, lora_resident=("",)),
                                 dict(lora_slots=1, lora_resident=["a"]), dict(lora_slots=-1)])
def test_reported_slots_are_bounded(bad):
    with pytest.raises(ValueError, match="lora_"):
        WorkerLoad(**bad)


def test_a_request_names_a_bounded_identity():
    with pytest.raises(ValueError, match="lora must be"):
        PlacementRequest("r", 10, 1, lora="x" * 257)
