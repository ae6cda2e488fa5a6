"""Prefix-aware placement on hand-computed states: a worker's queue less the work its cached
prefix of the request saves (prefill on the prompt side, transfer on the token side), within the
blind rules' eligibility and thresholds; with prefix_aware off, the blind decisions."""
import random

import pytest

from splitserve.placement import ClusterState, Placement, PlacementRequest, PlacementThresholds, Role, WorkerLoad
from splitserve.placement.state import PrefixDelta, PrefixOptions
from tests.placement.placement_helpers import A100, H100, load, pair

BS = 16
CHAIN = tuple(range(500, 600))  # the request's block hashes: up to 1600 cached tokens


def prefixed(num_prompt_tokens: int = 2000, max_tokens: int = 10, hashes=CHAIN) -> PlacementRequest:
    return PlacementRequest("r", num_prompt_tokens, max_tokens, prefix_hashes=tuple(hashes))


def state_of(policy: str, workers: dict, prefix: PrefixOptions = PrefixOptions(),
             thresholds: PlacementThresholds = PlacementThresholds()) -> ClusterState:
    """workers: id -> (pool, hardware, load, cached blocks of CHAIN); reported at time 1."""
    state = ClusterState(policy, thresholds, prefix)
    for worker_id, (pool, hardware, worker_load, blocks) in workers.items():
        state.add_worker(worker_id, pool, hardware)
        state.report(worker_id, worker_load, 1.0, PrefixDelta(BS, 1000, CHAIN[:blocks]))
    return state


P, T, M = Role.PROMPT, Role.TOKEN, Role.MIXED


@pytest.mark.parametrize("policy", ["jsq", "splitwise"])
def test_a_long_cached_prefix_beats_a_slightly_shorter_queue(policy):
    # p1: 600 - 64 x 16 = -424 < p0: 100; a short prefix does not: 600 - 2 x 16 = 568 > 100
    workers = {"p0": (P, H100, load(pending=100), 0), "p1": (P, H100, load(pending=600), 64),
               "t0": (T, H100, load(decode=1000), 0), "t1": (T, H100, load(decode=1500), 64)}
    assert pair(state_of(policy, workers), prefixed()) == ("p1", "t1")  # t1: 1500 - 1024 < 1000
    workers["p1"] = (P, H100, load(pending=600), 2)
    workers["t1"] = (T, H100, load(decode=1500), 2)
    assert pair(state_of(policy, workers), prefixed()) == ("p0", "t0")


def test_saved_prefill_counts_at_the_workers_speed():
    # a100 p1 holding 1024 tokens: (1000 - 1024) / 0.45 = -53 < h100 p0: 0; queued 1100: 76 / 0.45 = 169 > 0
    workers = {"p0": (P, H100, load(), 0), "p1": (P, A100, load(pending=1000), 64), "t0": (T, H100, load(), 0)}
    assert pair(state_of("jsq", workers), prefixed()) == ("p1", "t0")
    workers["p1"] = (P, A100, load(pending=1100), 64)
    assert pair(state_of("jsq", workers), prefixed()) == ("p0", "t0")


def test_never_an_overloaded_worker():
    limits = PlacementThresholds(max_queue_tokens=3000, max_decode_queue_tokens=20000)
    workers = {"p0": (P, H100, load(pending=2900), 0), "p1": (P, H100, load(pending=3000), 100),
               "t0": (T, H100, load(decode=19000), 0), "t1": (T, H100, load(decode=20000), 100),
               "t2": (T, H100, load(decode=0, free=1000, total=5000), 100)}  # no room for the whole prompt
    assert pair(state_of("jsq", workers, thresholds=limits), prefixed()) == ("p0", "t0")


def test_splitwise_holds_a_holders_prompt_queue_net_of_its_saving_to_the_threshold():
    """The prompt threshold bounds the queue a request meets: a holder's, less the prefill its
    cached prefix saves (2100 - 1600 <= 2048); a decode threshold the queue as it is (a transfer
    saved is no decode saved)."""
    workers = {"p0": (P, H100, load(pending=1000), 0), "p1": (P, H100, load(pending=2100), 100),
               "t0": (T, H100, load(decode=65000), 0), "t1": (T, H100, load(decode=66000), 100)}
    # p1: 2100 - 1600 < 1000, t1: 66000 - 1600 < 65000, but t1 is over mixed_decode_tokens (65536)
    assert pair(state_of("splitwise", workers), prefixed()) == ("p1", "t0")
    assert pair(state_of("jsq", workers), prefixed()) == ("p1", "t1")  # JSQ knows only backpressure
    workers["p1"] = (P, H100, load(pending=3700), 100)  # 3700 - 1600 > 2048, though < 1000 + 1600
    assert pair(state_of("splitwise", workers), prefixed()) == ("p0", "t0")


def test_a_holder_within_the_threshold_net_of_its_saving_keeps_the_request_off_the_mixed_pool():
    """Every prompt queue is over mixed_prompt_tokens, but the holder's less its saving is not: no overflow."""
    workers = {"p0": (P, H100, load(pending=3000), 0), "p1": (P, H100, load(pending=3000), 100),
               "t0": (T, H100, load(), 0), "m0": (M, H100, load(), 0)}
    placement, moves = state_of("splitwise", workers).place(prefixed(), 0.0)
    assert placement == Placement("p1", "t0") and not moves
    workers["p1"] = (P, H100, load(pending=3700), 100)
    placement, moves = state_of("splitwise", workers).place(prefixed(), 0.0)
    assert placement == Placement("m0", "m0")


def test_the_pair_takes_each_sides_own_prefix():
    """The token side often holds more (the last answer, decoded there); each side is scored alone."""
    workers = {"p0": (P, H100, load(), 0), "p1": (P, H100, load(pending=100), 20), "p2": (P, H100, load(), 10),
               "t0": (T, H100, load(), 10), "t1": (T, H100, load(decode=300), 60), "t2": (T, H100, load(), 0)}
    assert pair(state_of("jsq", workers), prefixed()) == ("p1", "t1")  # 100 - 320 < 0 - 160; 300 - 960 < -160
    # a request naming only the first 8 blocks: p1 and p2 save alike (128), t0 and t1 too
    assert pair(state_of("jsq", workers), prefixed(hashes=CHAIN[:8])) == ("p2", "t0")


def test_weights_scale_each_side():
    workers = {"p0": (P, H100, load(), 0), "p1": (P, H100, load(pending=500), 40),
               "t0": (T, H100, load(), 0), "t1": (T, H100, load(decode=500), 40)}
    assert pair(state_of("jsq", workers), prefixed()) == ("p1", "t1")  # 500 - 640 < 0
    no_transfer = PrefixOptions(transfer_saved_weight=0)
    assert pair(state_of("jsq", workers, no_transfer), prefixed()) == ("p1", "t0")
    half = PrefixOptions(prefill_saved_weight=0.5, transfer_saved_weight=0.5)
    assert pair(state_of("jsq", workers, half), prefixed()) == ("p0", "t0")  # 500 - 320 > 0


def test_an_excluded_or_stale_holder_is_not_preferred():
    workers = {"p0": (P, H100, load(pending=100), 0), "p1": (P, H100, load(pending=200), 50),
               "t0": (T, H100, load(), 0)}
    state = state_of("jsq", workers)
    assert pair(state, prefixed(), exclude={"p1"}) == ("p0", "t0")
    state.report("p0", load(pending=100), 2.0)
    state.report("p1", load(pending=200), 2.0, PrefixDelta(BS, 1000, removed=CHAIN[:1]))  # its root was evicted
    assert pair(state, prefixed()) == ("p0", "t0")


def test_the_mixed_pool_weighs_saved_prefill_and_transfer():
    # mixed-only: m1 (prompt 600 - 1024) beats m0 (prompt 200) on combined load
    workers = {"m0": (M, H100, load(pending=200), 0), "m1": (M, H100, load(pending=600), 64)}
    assert pair(state_of("jsq", workers), prefixed()) == ("m1", "m1")
    assert pair(state_of("splitwise", workers), prefixed()) == ("m1", "m1")
    # splitwise prompt overflow: the whole request on the mixed worker holding it
    over = {"p0": (P, H100, load(pending=3000), 0), "t0": (T, H100, load(), 0),
            "m0": (M, H100, load(pending=200), 0), "m1": (M, H100, load(pending=600), 64)}
    assert pair(state_of("splitwise", over), prefixed()) == ("m1", "m1")
    # token overflow: decode on the mixed worker holding it (transfer saved), the KV from p0
    over = {"p0": (P, H100, load(), 0), "t0": (T, H100, load(decode=70000), 0),
            "m0": (M, H100, load(decode=1000), 0), "m1": (M, H100, load(decode=2000), 64)}
    assert pair(state_of("splitwise", over), prefixed()) == ("p0", "m1")


def test_an_overflow_guest_is_the_holder_of_its_pool():
    workers = {"p0": (P, H100, load(pending=3000), 0), "t0": (T, H100, load(), 0),
               "t1": (T, H100, load(decode=300), 64)}
    placement, moves = state_of("splitwise", workers).place(prefixed(), 0.0)
    assert placement == Placement("t1", "t1") and [m.worker_id for m in moves] == ["t1"]


def run_session(prefix: PrefixOptions, informed: bool, seed: int = 11) -> list:
    """Random reports and placements; `informed`: reports carry prefix deltas, requests hashes."""
    rng = random.Random(seed)
    state = ClusterState("splitwise", PlacementThresholds(mixed_prompt_tokens=1500, mixed_decode_tokens=6000,
                                                          repurpose_after_s=5), prefix)
    for i in range(4):
        state.add_worker(f"p{i}", Role.PROMPT, rng.choice([H100, A100]))
        state.add_worker(f"t{i}", Role.TOKEN, rng.choice([H100, A100]))
    outcomes = []
    for step in range(300):
        worker_id = rng.choice(sorted(state.workers))
        worker_load = WorkerLoad(pending_prompt_tokens=rng.choice([0, rng.randint(1, 3000)]),
                                 decode_tokens=rng.choice([0, rng.randint(1, 9000)]), free_kv_tokens=20000,
                                 total_kv_tokens=20000)
        delta = PrefixDelta(BS, 1000, CHAIN[:rng.randint(0, 100)], snapshot=True)
        outcomes.append(state.report(worker_id, worker_load, step * 0.1, delta if informed else None))
        hashes = CHAIN[:rng.randint(0, 100)]
        req = PlacementRequest(f"r{step}", rng.randint(1, 2000), rng.randint(1, 500),
                               prefix_hashes=hashes if informed else ())
        outcomes.append(state.place(req, step * 0.1, exclude=rng.sample(sorted(state.workers), 1)))
    return outcomes


def test_prefix_aware_off_is_the_blind_placement():
    blind = run_session(PrefixOptions(), informed=False)
    assert run_session(PrefixOptions(aware=False), informed=True) == blind
    assert run_session(PrefixOptions(), informed=True) != blind  # on, the same session places otherwise


@pytest.mark.parametrize("policy", ["jsq", "splitwise"])
def test_a_prompt_only_request_runs_whole_where_its_prefix_saves_the_most(policy):
    """As a split request's prompt side: p1 (600 - 64 x 16 < 100) though its queue is longer."""
    workers = {"p0": (P, H100, load(pending=100), 0), "p1": (P, H100, load(pending=600), 64),
               "t0": (T, H100, load(), 64)}
    assert pair(state_of(policy, workers), prefixed(max_tokens=1)) == ("p1", "p1")
    workers["p1"] = (P, H100, load(pending=600), 2)
    assert pair(state_of(policy, workers), prefixed(max_tokens=1)) == ("p0", "p0")
