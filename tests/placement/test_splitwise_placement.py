"""The Splitwise policy (IV-A): overflow into the mixed pool on either side, the way back home,
re-purposing after a long stay and its rate limit, which never empties a home pool."""
import pytest

from splitserve.placement import Placement, PlacementThresholds, PoolMove, Role
from tests.placement.placement_helpers import A100, H100, cluster, idle, load, pair, request

OVER_PROMPT = load(pending=3000)  # > mixed_prompt_tokens (2048) on an h100
OVER_TOKEN = load(decode=70000)  # > mixed_decode_tokens (65536)


def test_without_overflow_it_is_jsq():
    state = cluster("splitwise", prompt=[("pa", A100, load(pending=1000)), ("ph", H100, load(pending=1500))],
                    token=[("ta", A100, load(decode=3000)), ("th", H100, load(decode=4000))])
    assert pair(state) == ("ph", "th")


def test_prompt_backlog_moves_the_least_loaded_token_worker_into_the_mixed_pool():
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)],
                    token=[("t0", H100, load(decode=500)), ("t1", H100, load(decode=100))])
    placement, moves = state.place(request(500, 100), now=3.0)
    assert placement == Placement("t1", "t1") and placement.local
    assert moves == [PoolMove("t1", Role.MIXED, "prompt queues over mixed_prompt_tokens")]
    t1 = state.workers["t1"]
    assert (t1.home, t1.pool, t1.mixed_since) == (Role.TOKEN, Role.MIXED, 3.0)
    assert (t1.placed_prompt_tokens, t1.placed_decode_tokens) == (500, 600)
    assert state.pools() == {Role.PROMPT: ["p0"], Role.TOKEN: ["t0"], Role.MIXED: ["t1"]}
    state.check_integrity()
    # t1's prompt queue (500) is within the threshold, so the next overflow reuses it without a move
    assert pair(state, request(1000, 10), now=4.0) == ("t1", "t1")


def test_a_mixed_worker_over_the_threshold_is_not_reused_and_even_the_last_token_worker_moves_in():
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)], token=[idle("t0"), idle("t1")])
    assert state.place(request(2100), 0.0)[0] == Placement("t0", "t0")  # t0 moves in; its queue is now 2100
    # the mixed worker is over the threshold: t1, the token pool's last, moves in and keeps decoding there
    placement, moves = state.place(request(100), 0.0)
    assert placement == Placement("t1", "t1") and [m.worker_id for m in moves] == ["t1"]
    assert state.pools()[Role.TOKEN] == [] and state.pools()[Role.MIXED] == ["t0", "t1"]


def test_an_empty_token_pool_overflows_decodes_to_the_mixed_pool():
    state = cluster("splitwise", prompt=[idle("p0")], token=[idle("t0")])
    state.workers["p0"].load = OVER_PROMPT
    assert state.place(request(100), 0.0)[0] == Placement("t0", "t0")
    state.report("p0", load(), now=1.0)  # the prompt backlog is gone; t0 still has its prompt
    assert pair(state, request(100)) == ("p0", "t0")  # decodes go to the mixed worker, KV p0 -> t0


def test_no_prompt_candidate_at_all_overflows_or_refuses():
    limits = PlacementThresholds(max_queue_tokens=3000)
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)], token=[idle("t0"), idle("t1")],
                    thresholds=limits)
    assert state.place(request(), 0.0)[0] == Placement("t0", "t0")
    lone_token = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)], token=[idle("t0")], thresholds=limits)
    assert lone_token.place(request(), 0.0, exclude={"t0"}) == (None, [])


def test_the_guest_goes_home_on_the_report_that_shows_its_prompts_drained():
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)], token=[idle("t0"), idle("t1")])
    state.place(request(500), 0.0)
    assert state.report("t0", load(pending=200, decode=600, decoding=1), now=1.0) == []  # prompts still pending
    assert state.report("p0", load(), now=1.5) == []  # another worker's report leaves it alone
    assert state.workers["t0"].pool is Role.MIXED
    moves = state.report("t0", load(decode=700, decoding=1), now=2.0)
    assert moves == [PoolMove("t0", Role.TOKEN, "drained its prompt work")]
    assert (state.workers["t0"].pool, state.workers["t0"].mixed_since) == (Role.TOKEN, None)
    state.check_integrity()


def test_decode_backlog_moves_a_prompt_worker_in_to_decode():
    # p0 has the shortest prompt queue; p1 the least combined load (500/2048 < 0 + 30000/65536)
    state = cluster("splitwise", token=[("t0", H100, OVER_TOKEN)],
                    prompt=[("p0", H100, load(decode=30000, decoding=20)), ("p1", H100, load(pending=500))])
    placement, moves = state.place(request(400, 100), now=5.0)
    assert placement == Placement("p0", "p1") and not placement.local  # the KV goes p0 -> p1
    assert moves == [PoolMove("p1", Role.MIXED, "token queues over mixed_decode_tokens")]
    assert state.workers["p1"].placed_decode_tokens == 500 and state.workers["p1"].mixed_since == 5.0
    assert pair(state, request(400, 100)) == ("p0", "p1")  # within the decode threshold: reused
    assert state.report("p1", load(pending=0, decode=900, decoding=2), now=6.0) == []  # still decoding
    assert state.report("p1", load(), now=7.0) == [PoolMove("p1", Role.PROMPT, "drained its token work")]


def test_decode_overflow_onto_the_chosen_prompt_worker_runs_locally():
    state = cluster("splitwise", prompt=[idle("p0"), ("p1", H100, load(pending=100))],
                    token=[("t0", H100, OVER_TOKEN)])
    placement, moves = state.place(request(), 0.0)
    assert placement == Placement("p0", "p0") and [m.worker_id for m in moves] == ["p0"]


def test_the_last_prompt_worker_moves_in_to_decode_and_prompts_follow_it():
    state = cluster("splitwise", prompt=[idle("p0")], token=[("t0", H100, OVER_TOKEN)])
    placement, moves = state.place(request(), 0.0)
    assert placement == Placement("p0", "p0") and [m.worker_id for m in moves] == ["p0"]
    assert pair(state) == ("p0", "p0")  # the prompt pool is empty: prompts overflow to the mixed pool
    full = PlacementThresholds(max_decode_queue_tokens=70000)
    refused = cluster("splitwise", prompt=[idle("p0")], token=[("t0", H100, OVER_TOKEN)], thresholds=full)
    assert refused.place(request(), 0.0, exclude={"p0"}) == (None, [])


def test_home_mixed_workers_form_the_mixed_pool_and_never_leave_it():
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)], token=[idle("t0"), idle("t1")],
                    mixed=[("m0", H100, load(decode=1000))])
    placement, moves = state.place(request(), 0.0)
    assert placement == Placement("m0", "m0") and moves == []
    assert state.report("m0", load(), now=100.0) == [] and state.workers["m0"].mixed_since is None


def guest_cluster(num_token_workers: int = 3):
    """p0 over its threshold; every placement moves one more token worker into the mixed pool."""
    state = cluster("splitwise", prompt=[("p0", H100, OVER_PROMPT)],
                    token=[idle(f"t{i}") for i in range(num_token_workers)])
    for i in range(num_token_workers - 1):
        state.place(request(2100, request_id=f"r{i}"), now=0.0)
    return state


BUSY = load(pending=500)  # a guest still holding prompts


def test_a_long_stay_repurposes_the_guest_once_per_period():
    state = guest_cluster()
    assert state.pools()[Role.MIXED] == ["t0", "t1"]
    assert state.report("t0", BUSY, now=59.0) == []
    moves = state.report("t0", BUSY, now=60.0)
    assert moves == [PoolMove("t0", Role.PROMPT, "mixed for 60s: re-purposed from token", repurposed=True)]
    t0 = state.workers["t0"]
    assert (t0.home, t0.pool, t0.mixed_since) == (Role.PROMPT, Role.PROMPT, None)
    assert state.report("t1", BUSY, now=90.0) == []  # rate limit: one per 60 s cluster-wide
    assert state.report("t1", BUSY, now=120.0)[0].repurposed
    assert state.workers["t1"].home is Role.PROMPT
    state.check_integrity()


def test_repurposing_never_takes_the_last_worker_of_a_home():
    state = guest_cluster(num_token_workers=2)  # t0 is a guest, t1 the token pool's last worker
    state.remove_worker("t1")  # t1 died: t0 is now the only token-home worker
    assert state.report("t0", BUSY, now=100.0) == []
    assert state.workers["t0"].home is Role.TOKEN


@pytest.mark.parametrize("now", [0.0, 10.0])
def test_an_idle_guest_goes_home_rather_than_being_repurposed(now):
    state = guest_cluster()
    assert state.report("t0", load(), now=now + 60.0) == [PoolMove("t0", Role.TOKEN, "drained its prompt work")]
