"""ClusterState with the round-robin and JSQ policies: hand-computed placements, accounting between
reports, eligibility (exclusion, backpressure, KV room), the mixed-only baseline, and the API edges."""
import json
import random
from dataclasses import replace

import pytest

from splitserve.placement import (
    PLACEMENT_POLICIES,
    ClusterState,
    Placement,
    PlacementRequest,
    PlacementThresholds,
    Role,
    WorkerLoad,
    make_placement_policy,
)
from tests.placement.placement_helpers import A100, H100, cluster, idle, load, pair, request


# ---- JSQ -------------------------------------------------------------------------------------
def test_jsq_compares_queues_weighted_by_hardware_speed():
    # a100 prompt: 1000 / 0.45 = 2222 > h100: 1500; a100 token: 3000 / 0.67 = 4478 > h100: 4000
    state = cluster("jsq", prompt=[("pa", A100, load(pending=1000)), ("ph", H100, load(pending=1500))],
                    token=[("ta", A100, load(decode=3000)), ("th", H100, load(decode=4000))])
    assert pair(state) == ("ph", "th")


def test_jsq_prefers_the_slower_class_when_its_weighted_queue_is_shorter():
    state = cluster("jsq", prompt=[("pa", A100, load(pending=600)), ("ph", H100, load(pending=1500))],
                    token=[("ta", A100, load(decode=2000)), ("th", H100, load(decode=4000))])
    assert pair(state) == ("pa", "ta")  # 600 / 0.45 = 1333 < 1500; 2000 / 0.67 = 2985 < 4000


def test_jsq_ties_go_to_the_lowest_id_whatever_the_join_order():
    state = cluster("jsq", prompt=[idle("p2"), idle("p1")], token=[idle("t9"), idle("t3")])
    assert pair(state) == ("p1", "t3")


def test_placements_between_reports_are_counted_so_they_spread():
    state = cluster("jsq", prompt=[idle("p0"), idle("p1")], token=[idle("t0"), idle("t1")])
    assert pair(state, request(500, 100)) == ("p0", "t0")
    assert state.workers["p0"].prompt_queue() == 500 and state.workers["t0"].token_queue() == 600
    assert pair(state, request(500, 100)) == ("p1", "t1")
    assert pair(state, request(500, 100)) == ("p0", "t0")
    assert state.workers["p0"].placed_prompt_tokens == 1000 and state.workers["t0"].placed_decode_tokens == 1200


def test_a_report_replaces_the_estimate():
    state = cluster("jsq", prompt=[idle("p0"), idle("p1")], token=[idle("t0")])
    pair(state, request(500, 100))
    assert state.report("p0", load(pending=20), now=1.0) == []
    assert state.workers["p0"].placed_prompt_tokens == 0 and state.workers["p0"].prompt_queue() == 20
    assert state.workers["p0"].reported_at == 1.0
    assert state.workers["t0"].placed_decode_tokens == 600  # only the reporter's estimate is replaced
    assert pair(state) == ("p1", "t0")


def test_excluded_workers_are_skipped():
    state = cluster("jsq", prompt=[idle("p0"), idle("p1")], token=[idle("t0"), idle("t1")])
    assert pair(state, exclude=["p0", "t0"]) == ("p1", "t1")
    assert pair(state, exclude={"p0", "p1"}) is None


@pytest.mark.parametrize("policy", ["round-robin", "jsq", "splitwise"])
def test_backpressure_refuses_when_every_queue_is_full(policy):
    limits = PlacementThresholds(max_queue_tokens=1000, max_decode_queue_tokens=5000)
    full_prompt = cluster(policy, prompt=[("p0", H100, load(pending=1000))], token=[idle("t0")], thresholds=limits)
    # Splitwise still has room: the idle token worker moves into the mixed pool and runs it whole
    assert full_prompt.place(request(), 0.0)[0] == (Placement("t0", "t0") if policy == "splitwise" else None)
    full = cluster(policy, prompt=[("p0", H100, load(pending=1000))], token=[("t0", H100, load(decode=5000))],
                   thresholds=limits)
    assert full.place(request(), 0.0)[0] is None
    full_token = cluster(policy, prompt=[idle("p0")], token=[("t0", H100, load(decode=5000))], thresholds=limits)
    expected = Placement("p0", "p0") if policy == "splitwise" else None
    assert full_token.place(request(), 0.0)[0] == expected
    full_token = cluster(policy, prompt=[idle("p0")], token=[("t0", H100, load(decode=5000))], thresholds=limits)
    assert full_token.place(request(), 0.0, exclude={"p0"})[0] is None
    assert full_token.workers["p0"].placed_prompt_tokens == 0  # a refusal places nothing


@pytest.mark.parametrize("policy", ["round-robin", "jsq", "splitwise"])
def test_background_requests_are_refused_past_their_share_of_the_prompt_queues(policy):
    """Priority above 0 is placed only while some prefilling worker's queue is under
    `background_share` of the bound; priority 0 and below get the whole bound. A refused
    background request places nothing and moves no pool."""
    limits = PlacementThresholds(max_queue_tokens=1000, background_share=0.5)

    def state(*pending: int):
        return cluster(policy, prompt=[(f"p{i}", H100, load(pending=p)) for i, p in enumerate(pending)],
                       token=[idle("t0")], thresholds=limits)

    background = PlacementRequest("b", 100, 10, priority=1)
    busy = state(600, 500)
    assert busy.place(background, 0.0) == (None, [])
    assert busy.workers["p0"].placed_prompt_tokens == busy.workers["p1"].placed_prompt_tokens == 0
    assert busy.place(PlacementRequest("i", 100, 10, priority=0), 0.0)[0] is not None
    assert busy.place(PlacementRequest("u", 100, 10, priority=-4), 0.0)[0] is not None
    assert state(600, 499).place(background, 0.0)[0] is not None
    with pytest.raises(ValueError, match="background_share must be in"):
        PlacementThresholds(background_share=0)


@pytest.mark.parametrize("policy", ["round-robin", "jsq"])
def test_token_worker_needs_kv_room_for_the_prompt_and_first_token(policy):
    state = cluster(policy, prompt=[idle("p0")], token=[("t0", H100, load(free=100, total=1000)),
                                                       ("t1", H100, load(decode=900, free=101, total=1000))])
    assert pair(state, request(100, 50)) == ("p0", "t1")  # t0 is emptier but has 100 < 101 free
    assert state.workers["t1"].free_kv_tokens() == 101 - 150
    assert pair(state, request(100, 50)) is None  # placed tokens count against free KV until a report


def test_a_sliding_window_token_worker_has_room_for_prompts_longer_than_its_free_kv():
    """Every layer windowed: a sequence holds a window's KV however long (272 slots here); every
    other layer: half its tokens and half a window's. Placed requests count as much until a report."""
    every = replace(load(free=1000, total=4000), kv_groups=1, kv_full_groups=0, kv_window_tokens=272)
    other = replace(load(free=2000, total=4000), kv_groups=2, kv_full_groups=1, kv_window_tokens=272)
    state = cluster("jsq", prompt=[idle("p0")], token=[("t0", H100, every), ("t1", H100, other)])
    assert pair(state, request(3000, 50)) == ("p0", "t0")
    assert state.workers["t0"].placed_kv_tokens == 272 and state.workers["t0"].placed_decode_tokens == 3050
    assert pair(state, request(3000, 50), exclude={"t0"}) == ("p0", "t1")
    assert state.workers["t1"].placed_kv_tokens == -(-(3050 + 272) // 2)  # 1661 of its 2000 free
    assert pair(state, request(3000, 50), exclude={"t0"}) is None
    full = cluster("jsq", prompt=[idle("p0")], token=[("t0", H100, load(free=1000, total=4000))])
    assert pair(full, request(3000, 50)) is None  # a full-attention worker needs every token's


@pytest.mark.parametrize("policy", ["round-robin", "jsq"])
def test_a_windowed_import_asks_room_for_the_full_groups_growth(policy):
    """Every other layer windowed: the import of 3000 tokens holds 1637 of the free KV, and the token
    worker asks room for the full groups' growth too, its own (25 of 50 tokens) and its decodes'
    (`kv_growth_tokens`), at most a whole prompt's 3001. A whole request runs without that headroom."""
    windowed = dict(kv_groups=2, kv_full_groups=1, kv_window_tokens=272)
    growing = replace(load(free=2000, total=4000), **windowed, kv_growth_tokens=400)
    steady = replace(load(decode=500, free=2000, total=4000), **windowed, kv_growth_tokens=300)
    state = cluster(policy, prompt=[idle("p0")], token=[("t0", H100, growing), ("t1", H100, steady)])
    assert steady.import_tokens(3001, 50) == 1637 + 25 + 300 and growing.import_tokens(3001, 50) == 1637 + 25 + 400
    assert pair(state, request(3000, 50), exclude={"t1"}) is None  # 2062 > 2000 free
    assert pair(state, request(3000, 50)) == ("p0", "t1")  # 1962 of its 2000
    assert replace(growing, kv_growth_tokens=10**6).import_tokens(3001, 50) == 3001
    whole = cluster(policy, mixed=[("m0", H100, growing)])
    assert pair(whole, request(3000, 50)) == ("m0", "m0")


def test_a_token_worker_with_a_preempted_sequence_waiting_takes_no_import():
    """It would refuse the reservation (Policy.reserve_import) until that sequence runs again; a
    whole request may still run there."""
    waiting = replace(load(free=1000, total=1000), num_waiting=1, num_preempted=1)
    state = cluster("jsq", prompt=[idle("p0")], token=[("t0", H100, waiting), ("t1", H100, load(decode=500))])
    assert pair(state, request(100, 10)) == ("p0", "t1")  # t0's queue is shorter
    assert pair(state, request(100, 10), exclude={"t1"}) is None
    whole = cluster("jsq", mixed=[("m0", H100, waiting)])
    assert pair(whole, request(100, 10)) == ("m0", "m0")


def test_kv_check_is_skipped_until_capacity_is_reported():
    state = cluster("jsq", prompt=[idle("p0")], token=[("t0", H100, load(free=0, total=0))])
    assert pair(state, request(4000, 10)) == ("p0", "t0")


# ---- round-robin -----------------------------------------------------------------------------
def test_round_robin_cycles_each_pool_independently_and_ignores_load():
    state = cluster("round-robin", prompt=[("p0", H100, load(pending=9000)), idle("p1"), idle("p2")],
                    token=[idle("t0"), idle("t1")])
    placed = [pair(state) for _ in range(4)]
    assert placed == [("p0", "t0"), ("p1", "t1"), ("p2", "t0"), ("p0", "t1")]


def test_round_robin_skips_ineligible_and_survives_membership_changes():
    state = cluster("round-robin", prompt=[idle("p0"), idle("p1"), idle("p2")], token=[idle("t0")])
    assert pair(state, exclude=["p1"]) == ("p0", "t0")
    assert pair(state, exclude=["p1"]) == ("p2", "t0")
    state.remove_worker("p0")
    assert pair(state) == ("p1", "t0")  # the cycle resumes after p2, wrapping to the next id
    state.add_worker("p3", Role.PROMPT, H100)
    assert pair(state) == ("p2", "t0")
    assert pair(state) == ("p3", "t0")


def test_round_robin_does_not_advance_on_a_refusal():
    state = cluster("round-robin", prompt=[idle("p0"), idle("p1")], token=[idle("t0")])
    assert pair(state, exclude=["t0"]) is None
    assert pair(state) == ("p0", "t0")


# ---- the mixed-only baseline -----------------------------------------------------------------
def test_baseline_round_robin_places_whole_requests_in_turn():
    state = cluster("round-robin", mixed=[idle("m0"), idle("m1")])
    assert [pair(state) for _ in range(3)] == [("m0", "m0"), ("m1", "m1"), ("m0", "m0")]


@pytest.mark.parametrize("policy", ["jsq", "splitwise"])
def test_baseline_picks_the_least_combined_load(policy):
    # combined load = prompt queue / 2048 + token queue / 65536: m0 = 1024/2048 = 0.5;
    # m1 = 16384/65536 + 256/2048 = 0.375 (more raw tokens, less load); m2 has no KV room
    state = cluster(policy, mixed=[("m0", H100, load(pending=1024)), ("m1", H100, load(decode=16384, pending=256)),
                                   ("m2", H100, load(free=10, total=1000))])
    placement, moves = state.place(request(100, 10), 0.0)
    assert placement == Placement("m1", "m1") and placement.local and moves == []
    assert state.workers["m1"].placed_prompt_tokens == 100 and state.workers["m1"].placed_decode_tokens == 110
    assert state.pools()[Role.MIXED] == ["m0", "m1", "m2"]


# ---- ClusterState API ------------------------------------------------------------------------
def test_membership_and_pools():
    state = cluster("jsq", prompt=[idle("p1"), idle("p0")], token=[idle("t0")])
    with pytest.raises(ValueError, match="already"):
        state.add_worker("p0", Role.TOKEN, H100)
    state.add_worker("x", "mixed", "a100")  # names are accepted too
    assert state.workers["x"].hardware is A100 and state.workers["x"].mixed_since is None
    assert state.pools() == {Role.PROMPT: ["p0", "p1"], Role.TOKEN: ["t0"], Role.MIXED: ["x"]}
    state.remove_worker("p0")
    state.remove_worker("nobody")
    assert state.pools()[Role.PROMPT] == ["p1"] and "p0" not in state.workers
    assert state.report("nobody", WorkerLoad(), 1.0) == []
    state.check_integrity()


def test_snapshot_is_json():
    state = cluster("jsq", prompt=[("p0", A100, load(pending=90))], token=[idle("t0")])
    state.place(request(), 0.0)
    snapshot = json.loads(json.dumps(state.snapshot()))
    assert snapshot["policy"] == "jsq" and snapshot["pools"] == {"prompt": ["p0"], "token": ["t0"], "mixed": []}
    assert snapshot["thresholds"]["mixed_prompt_tokens"] == 2048
    p0 = snapshot["workers"]["p0"]
    assert (p0["home"], p0["pool"], p0["hardware"], p0["pending_prompt_tokens"]) == ("prompt", "prompt", "a100", 90)
    assert p0["prompt_queue"] == pytest.approx(190 / 0.45) and p0["mixed_since"] is None


def test_policies_by_name():
    assert set(PLACEMENT_POLICIES) == {"round-robin", "jsq", "splitwise"}
    assert make_placement_policy("jsq").name == "jsq"
    assert ClusterState().policy.name == "splitwise"
    with pytest.raises(ValueError, match="round-robin, jsq, splitwise.*'fifo'"):
        ClusterState("fifo")


@pytest.mark.parametrize("make, field", [
    (lambda: PlacementRequest("r", 0, 10), "num_prompt_tokens"),
    (lambda: PlacementRequest("r", 10, -1), "max_tokens"),
    (lambda: PlacementRequest("", 10, 1), "request_id"),
    (lambda: WorkerLoad(decode_tokens=-5), "decode_tokens"),
    (lambda: WorkerLoad(kv_groups=0, kv_full_groups=0), "kv_groups"),
    (lambda: WorkerLoad(kv_groups=1, kv_full_groups=2), "kv_groups"),
    (lambda: WorkerLoad(kv_window_tokens=-1), "kv_window_tokens"),
    (lambda: WorkerLoad(num_preempted=-1), "num_preempted"),
    (lambda: PlacementThresholds(mixed_prompt_tokens=0), "mixed_prompt_tokens"),
    (lambda: PlacementThresholds(repurpose_after_s=-1), "repurpose_after_s"),
    (lambda: ClusterState("jsq", thresholds={"max_queue_tokens": 5}), "thresholds"),
    (lambda: ClusterState("jsq").add_worker("w", "gpu", H100), "home must be one of prompt, token, mixed"),
    (lambda: ClusterState("jsq").add_worker("", "prompt", H100), "worker_id"),
])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def run_random_session(policy: str, seed: int) -> list:
    """Random joins, reports, placements and removals; returns every outcome."""
    rng = random.Random(seed)
    state = cluster(policy, prompt=[idle(f"p{i}", rng.choice([H100, A100])) for i in range(4)],
                    token=[idle(f"t{i}", rng.choice([H100, A100])) for i in range(4)],
                    thresholds=PlacementThresholds(mixed_prompt_tokens=1500, mixed_decode_tokens=6000,
                                                   repurpose_after_s=5))
    outcomes = []
    for step in range(300):
        worker_id = rng.choice(sorted(state.workers))
        worker_load = load(pending=rng.choice([0, rng.randint(1, 3000)]), decode=rng.choice([0, rng.randint(1, 9000)]),
                           decoding=rng.randint(0, 3), free=20000, total=20000)
        outcomes.append(state.report(worker_id, worker_load, now=step * 0.1))
        outcomes.append(state.place(request(rng.randint(1, 2000), rng.randint(1, 500), f"r{step}"), step * 0.1,
                                    exclude=rng.sample(sorted(state.workers), 1)))
        state.check_integrity()
    return outcomes + [state.snapshot()]


@pytest.mark.parametrize("policy", ["round-robin", "jsq", "splitwise"])
def test_decisions_are_deterministic(policy):
    assert run_random_session(policy, seed=7) == run_random_session(policy, seed=7)


def test_a_following_request_goes_to_the_workers_it_follows_while_they_qualify():
    """`n` > 1: later choices follow the first one's workers (their prefix caches hold the prompt),
    though JSQ would pick others; a followed worker that is excluded, gone or full is not used."""
    state = cluster("jsq", prompt=[("p1", H100, load(pending=4000)), ("p2", H100, load())],
                    token=[("t1", H100, load(decode=9000)), ("t2", H100, load())])
    follow = Placement("p1", "t1")
    following = PlacementRequest("r", 100, 10, follow=follow)
    assert pair(state, following) == ("p1", "t1")
    assert pair(state, request()) == ("p2", "t2")
    assert pair(state, following, exclude=["t1"]) == ("p2", "t2")
    full = cluster("jsq", prompt=[("p1", H100, load(pending=10**9)), ("p2", H100, load())],
                   token=[("t1", H100, load()), ("t2", H100, load())])
    assert pair(full, following) == ("p2", "t1")
    state.remove_worker("p1")
    assert pair(state, following)[0] == "p2"


def test_a_local_placement_is_followed_while_its_worker_can_run_the_request_whole():
    """No import there: a preempted sequence waiting, or a windowed decode's growth, does not stop it
    (though the other worker's queues are shorter)."""
    waiting = replace(load(pending=500, free=1000, total=4000), num_preempted=1, num_waiting=1, kv_groups=2,
                      kv_full_groups=1, kv_window_tokens=272, kv_growth_tokens=10**6)
    state = cluster("jsq", mixed=[("m0", H100, waiting), ("m1", H100, load())])
    following = PlacementRequest("r", 1000, 10, follow=Placement("m0", "m0"))
    assert pair(state, following) == ("m0", "m0")
    assert pair(state, PlacementRequest("r", 2000, 10, follow=Placement("m0", "m0"))) == ("m1", "m1")  # no KV room


# ---- prompt-only requests (max_tokens 1) ----------------------------------------------------------
@pytest.mark.parametrize("policy", ["round-robin", "jsq", "splitwise"])
def test_a_prompt_only_request_runs_whole_on_a_prompt_worker_whatever_the_token_pool(policy):
    """Its one token is its prefill's: it needs no token worker, so a token pool that is full, out
    of KV or excluded refuses nothing; its accounting lands on that prompt worker alone."""
    limits = PlacementThresholds(max_queue_tokens=1000, max_decode_queue_tokens=5000)
    state = cluster(policy, prompt=[("p0", H100, load(pending=300)), idle("p1")],
                    token=[("t0", H100, load(decode=5000, free=10, total=1000))], thresholds=limits)
    first = "p0" if policy == "round-robin" else "p1"  # the cycle's first, or the shorter queue
    assert pair(state, request(100, 1)) == (first, first)
    assert (state.workers[first].placed_prompt_tokens, state.workers[first].placed_decode_tokens) == (100, 101)
    assert state.workers["t0"].placed_decode_tokens == 0
    assert pair(state, request(100, 0), exclude={"t0"}) is not None  # echo's max_tokens 0 too
    assert pair(state, request(100, 1), exclude={"p0", "p1"}) is None
    if policy != "splitwise":  # (which moves a prompt worker in to decode)
        assert pair(state, request(100, 2)) is None  # a decode needs t0, which is full


def test_a_prompt_only_request_follows_the_prompt_pools_rules():
    """JSQ's shortest prompt queue (its cached prefix counts, `prefix.aware`); Splitwise past
    `mixed_prompt_tokens` overflows it into the mixed pool as it would any request, or with no
    overflow target keeps it on the prompt worker; a mixed-only cluster runs it as any other."""
    state = cluster("jsq", prompt=[("pa", A100, load(pending=1000)), ("ph", H100, load(pending=1500))],
                    token=[idle("t0")])
    assert pair(state, request(100, 1)) == ("ph", "ph")  # 1500 < 1000 / 0.45
    over = cluster("splitwise", prompt=[("p0", H100, load(pending=3000))], token=[idle("t0")])
    placement, moves = over.place(request(100, 1), 0.0)
    assert placement == Placement("t0", "t0") and [m.worker_id for m in moves] == ["t0"]
    no_target = cluster("splitwise", prompt=[("p0", H100, load(pending=3000))], token=[idle("t0")])
    assert pair(no_target, request(100, 1), exclude={"t0"}) == ("p0", "p0")  # never split: no KV to move
    # the prompt pool's worker decodes as a mixed guest with a long prompt queue, the token pool is full
    guest = cluster("splitwise", prompt=[("p0", H100, load(pending=3000))],
                    token=[("t0", H100, load(decode=70000, free=10, total=1000))])
    moves = guest.place(request(100, 8), 0.0)[1]
    assert [(m.worker_id, m.to_pool) for m in moves] == [("p0", Role.MIXED)]
    assert pair(guest, request(100, 1)) == ("p0", "p0")  # no prompt pool, no overflow target: the guest
    mixed = cluster("jsq", mixed=[("m0", H100, load(pending=500)), idle("m1")])
    assert pair(mixed, request(100, 1)) == ("m1", "m1")
