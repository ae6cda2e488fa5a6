"""The prefix-aware searches (placement/saved_work.py) pick what a brute-force search over every
eligible worker picks: the least queue less the saved work, ties to the lowest id."""
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
from splitserve.placement.saved_work import SavedWork, least_loaded_saving, prefer_cached_prompt, prefer_cached_token
from splitserve.placement.state import PrefixOptions
from tests.placement.placement_helpers import A100, H100, LIMITS, cluster, load, request

def random_state(rng: random.Random):
    def specs(prefix):
        return [(f"{prefix}{i:02d}", rng.choice([H100, A100]),
                 load(pending=rng.choice([0, 100, rng.randint(0, 3500)]), decode=rng.choice([0, rng.randint(0, 25000)]),
                      free=rng.randint(0, 3000), total=rng.choice([0, 3000])))
                for i in range(rng.randint(0, 6))]
    state = cluster("jsq", prompt=specs("p"), token=specs("t"), mixed=specs("m"), thresholds=LIMITS)
    for worker in state.workers.values():
        worker.placed_prompt_tokens, worker.placed_decode_tokens = rng.randint(0, 300), rng.randint(0, 300)
    cached = {w: rng.choice([16, 64, 1024, 2400]) for w in state.workers if rng.random() < 0.4}
    options = PrefixOptions(prefill_saved_weight=rng.choice([0.0, 1.0, 2.5]),
                            transfer_saved_weight=rng.choice([0, 1.0]))
    return state, SavedWork(cached, options)


def reference(workers, eligible, score):
    candidates = [w for w in workers if eligible(w)]
    return min(candidates, key=lambda w: (score(w), w.worker_id), default=None)


@pytest.mark.parametrize("seed", range(200))
def test_the_searches_match_a_brute_force_search(seed):
    rng = random.Random(seed)
    state, saved = random_state(rng)
    req = request(rng.randint(1, 2500), rng.randint(0, 100))
    exclude = frozenset(w for w in state.workers if rng.random() < 0.2)
    cap = rng.choice([math.inf, 1000.0])
    prompts, tokens = state.members(Role.PROMPT), state.members(Role.TOKEN)

    blind = least_prompt_queue(prompts, LIMITS, exclude)
    if blind is None or blind.prompt_queue() <= cap:  # what callers guarantee
        assert prefer_cached_prompt(state, blind, saved, exclude, cap) is reference(
            prompts, lambda w: can_prompt(w, LIMITS, exclude) and w.prompt_queue() <= cap,
            lambda w: w.prompt_queue() - saved.prefill(w))
    blind = least_token_queue(tokens, LIMITS, req, exclude)
    if blind is None or blind.token_queue() <= cap * 8:
        assert prefer_cached_token(state, blind, saved, req, exclude, cap * 8) is reference(
            tokens, lambda w: can_decode(w, LIMITS, req, exclude) and w.token_queue() <= cap * 8,
            lambda w: w.token_queue() - saved.transfer(w))
    for pool in Role:
        for decode_only in (False, True):
            prompt_cap, token_cap = (math.inf, cap * 8) if decode_only else (cap, math.inf)
            chosen = least_loaded_saving(state, pool, req, exclude, saved, decode_only, prompt_cap, token_cap)
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
    saved = SavedWork({"pa": 900, "ph": 900, "t": 900}, PrefixOptions(prefill_saved_weight=1.0,
                                                                      transfer_saved_weight=0.5))
    pa, ph, t = (state.workers[w] for w in ("pa", "ph", "t"))
    assert saved.prefill(ph) == 900 and saved.prefill(pa) == pytest.approx(900 / 0.45)  # as its queue counts
    assert saved.transfer(t) == 450  # the transfer is the network's, not the worker's speed
    assert saved.prefill(state.workers["t"]) == pytest.approx(2000) and saved.holders(state, Role.PROMPT) == [pa, ph]
