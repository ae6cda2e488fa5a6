"""The inlined hot-path scans in placement/base.py agree with the readable eligibility rules."""
import math
import random
from dataclasses import replace

import pytest

from splitserve.placement import Role
from splitserve.placement.base import (
    can_decode,
    can_prompt,
    can_run_whole,
    combined_load,
    least_loaded_whole,
    least_prompt_queue,
    least_token_queue,
)
from tests.placement.placement_helpers import A100, H100, LIMITS, cluster, load, request

def random_workers(rng: random.Random):
    windows = [{}, dict(kv_groups=1, kv_full_groups=0, kv_window_tokens=rng.randint(1, 600)),  # every layer slides
               dict(kv_groups=2, kv_full_groups=1, kv_window_tokens=rng.randint(1, 600),  # every other one
                    kv_growth_tokens=rng.choice([0, rng.randint(0, 2000)]))]
    specs = [(f"w{i:02d}", rng.choice([H100, A100]),
              replace(load(pending=rng.choice([0, 100, rng.randint(0, 3500)]),
                           decode=rng.choice([0, rng.randint(0, 25000)]), free=rng.randint(0, 3000),
                           total=rng.choice([0, 3000])), num_preempted=rng.choice([0, 0, 0, 1]), **rng.choice(windows)))
             for i in range(rng.randint(0, 12))]
    state = cluster("jsq", mixed=specs, thresholds=LIMITS)
    for worker in state.members(Role.MIXED):
        worker.placed_prompt_tokens, worker.placed_decode_tokens = rng.randint(0, 300), rng.randint(0, 300)
        worker.placed_kv_tokens = worker.load.kv_tokens(worker.placed_decode_tokens)
    return state.members(Role.MIXED)


def reference_min(candidates, key):
    """Readable reference: the least key, ties to the lowest id."""
    best = min(candidates, key=lambda w: (key(w), w.worker_id), default=None)
    return None if best is None else best.worker_id


def worker_id(worker):
    return None if worker is None else worker.worker_id


@pytest.mark.parametrize("seed", range(200))
def test_scans_match_the_rules(seed):
    rng = random.Random(seed)
    workers = random_workers(rng)
    req = request(rng.randint(1, 2500), rng.randint(0, 100))
    exclude = frozenset(w.worker_id for w in workers if rng.random() < 0.2)
    prompt_cap, token_cap = rng.choice([math.inf, 1000.0, 500.0]), rng.choice([math.inf, 8000.0])

    assert worker_id(least_prompt_queue(workers, LIMITS, exclude)) == reference_min(
        [w for w in workers if can_prompt(w, LIMITS, exclude)], lambda w: w.prompt_queue())
    assert worker_id(least_token_queue(workers, LIMITS, req, exclude)) == reference_min(
        [w for w in workers if can_decode(w, LIMITS, req, exclude)], lambda w: w.token_queue())
    whole = [w for w in workers if can_run_whole(w, LIMITS, req, exclude)
             and w.prompt_queue() <= prompt_cap and w.token_queue() <= token_cap]
    chosen = least_loaded_whole(workers, LIMITS, req, exclude, prompt_cap, token_cap)
    expected = reference_min(whole, lambda w: combined_load(w, LIMITS))
    if chosen is None or expected is None:
        assert worker_id(chosen) == expected
    else:  # the scan multiplies by 1 / threshold: equal loads may differ in the last bit
        assert combined_load(chosen, LIMITS) == pytest.approx(combined_load(
            next(w for w in workers if w.worker_id == expected), LIMITS), rel=1e-12)


def test_caps_are_inclusive():
    state = cluster("jsq", mixed=[("m0", H100, load(pending=1000))], thresholds=LIMITS)
    members = state.members(Role.MIXED)
    assert least_loaded_whole(members, LIMITS, request(), frozenset(), prompt_cap=1000) is members[0]
    assert least_loaded_whole(members, LIMITS, request(), frozenset(), prompt_cap=999.9) is None
