"""AccelGen's formulas and ordering rules on hand-made queues (../shared/notes/accelgen.md).

Unless a test says otherwise: 64 tokens take 64 ms (1 ms per token), budgets are multiples of 8
tokens and at most 256, blocks hold 4 tokens, prompts of 100+ tokens are long."""
from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import SchedulerLimits, SLOOptions, make_policy
from splitserve.engine.policies.plan import Plan, ScheduledSeq
from tests.engine.policy_helpers import complete, import_seq, make_seq, shape

OPTIONS = SLOOptions(pivot_tokens=64, pivot_time_s=0.064, tile_tokens=8, max_budget_tokens=256, window_s=0.75,
                     long_prompt_tokens=100, default_ttft_s=1.0, default_tbt_s=0.2)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def accelgen(num_blocks: int = 256, options: SLOOptions = OPTIONS, name: str = "accelgen"):
    clock = Clock()
    policy = make_policy(name, BlockManager(num_blocks, 4, enable_prefix_caching=False),
                         SchedulerLimits(slo=options), clock)
    return policy, clock


def test_token_budget_is_eq_6_floored_to_a_tile():
    # the notes' example: S_pf 768, T_pf 0.15 s, SLO_min 0.1875 s -> 960 tokens
    policy, _ = accelgen(options=SLOOptions(pivot_tokens=768, pivot_time_s=0.15, tile_tokens=16,
                                            max_budget_tokens=4096))
    assert policy.token_budget(0.1875) == 960
    assert policy.token_budget(0.19) == 960  # 972.8 tokens, floored to a multiple of 16
    policy, _ = accelgen()
    assert policy.token_budget(0.05) == 48 and policy.token_budget(0.0123) == 8
    assert policy.token_budget(0.001) == 8 and policy.token_budget(10.0) == 256  # at least a tile, at most the cap


def test_the_least_slack_goes_first_and_the_budget_follows_its_slo():
    policy, clock = accelgen(options=SLOOptions(**{**OPTIONS.__dict__, "long_prompt_tokens": 1000}))  # no ERA
    loose = make_seq("loose", 150, ttft_slo_s=5.0)
    tight = make_seq("tight", 150, start=500, ttft_slo_s=0.1)
    policy.add(loose)
    policy.add(tight)
    # tight: slack 0.1 - 0 - 3 chunks x 64 ms < T_max, urgent; its 0.1 s TTFT gives 96 tokens
    plan = policy.schedule()
    assert shape(plan) == [("tight", 96)] and policy.budget == 96
    complete(policy, plan)
    clock.now = 0.1
    # dynamic chunking: tight's last 54 tokens (urgent), then loose fills the budget to exactly 96
    plan = policy.schedule()
    assert shape(plan) == [("tight", 54), ("loose", 42)] and plan.num_tokens == 96
    complete(policy, plan)
    assert loose.num_computed_tokens == 42  # the next chunk resumes at token 42


def test_era_keeps_a_second_long_prompt_out_until_the_first_is_prefilled():
    policy, clock = accelgen(options=SLOOptions(**{**OPTIONS.__dict__, "max_budget_tokens": 64}))
    first, second = make_seq("long1", 120, ttft_slo_s=5.0), make_seq("long2", 120, start=300, ttft_slo_s=5.0)
    short = make_seq("short", 20, start=600, ttft_slo_s=5.0)
    for seq in (first, second, short):
        policy.add(seq)
    seen = []
    while not first.is_decoding:
        plan = policy.schedule()
        seen.append(shape(plan))
        complete(policy, plan)
        clock.now += 0.07
    assert all(seq_id != "long2" for step in seen for seq_id, _ in step)
    assert sum(n for step in seen for seq_id, n in step if seq_id == "long1") == 120
    assert any(seq_id == "short" for step in seen for seq_id, _ in step)  # short prompts still share the budget
    plan = policy.schedule()  # long1 decodes now: long2 may start
    assert "long2" in dict(shape(plan))


def test_an_urgent_prompt_preempts_the_running_sequence_with_the_most_slack():
    policy, clock = accelgen(num_blocks=8)
    tight = import_seq(policy, make_seq("tight", 12, tbt_slo_s=0.05))
    loose = import_seq(policy, make_seq("loose", 12, start=100, tbt_slo_s=5.0))
    urgent = make_seq("urgent", 12, start=200, ttft_slo_s=0.01)
    policy.add(urgent)  # needs 3 blocks; 2 are free (each decode holds 3)
    plan = policy.schedule()
    assert plan.preempted == (loose,)
    assert {"tight", "urgent"} <= set(dict(shape(plan)))
    assert loose.status.value == "waiting" and loose.num_computed_tokens == 0
    assert tight.status.value == "running"


def test_when_urgent_decodes_exceed_the_budget_the_most_slack_waits():
    policy, _ = accelgen()
    strict = [import_seq(policy, make_seq(f"s{i}", 4, start=10 * i, tbt_slo_s=0.005)) for i in range(8)]
    import_seq(policy, make_seq("r0", 4, start=100, tbt_slo_s=0.009))
    import_seq(policy, make_seq("r1", 4, start=110, tbt_slo_s=0.009))
    plan = policy.schedule()  # 0.005 s gives 5 tokens: one tile of 8
    assert sorted(seq_id for seq_id, _ in shape(plan)) == sorted(s.seq_id for s in strict)
    assert policy.budget == 8


def test_select_requests_takes_the_best_fit_for_compute_and_kv_not_the_oldest():
    # budget 32 tokens, KV 40 tokens free: the 32-token prompt fits both exactly, the older 8-token one does not
    policy, _ = accelgen(num_blocks=10, options=SLOOptions(**{**OPTIONS.__dict__, "max_budget_tokens": 32}))
    older = make_seq("older", 8, ttft_slo_s=5.0)
    exact = make_seq("exact", 32, start=100, ttft_slo_s=5.0)
    older.arrival_time, exact.arrival_time = 0.0, 0.001
    policy.add(older)
    policy.add(exact)
    # distances: exact (32 - 32, 40 - 32) = 8; older (32 - 8, 40 - 8) = 40
    assert shape(policy.schedule()) == [("exact", 32)]


def test_best_fit_stays_within_gamma_of_the_least_slack_then_the_next_window_fills_the_rest():
    policy, _ = accelgen(options=SLOOptions(**{**OPTIONS.__dict__, "max_budget_tokens": 32}))
    soon, later = make_seq("soon", 8, ttft_slo_s=1.0), make_seq("later", 32, start=100, ttft_slo_s=3.0)
    policy.add(soon)
    policy.add(later)
    # later fits the 32-token budget exactly, but its slack is 2 s more (outside gamma 0.75 s): soon
    # first, then later's window takes the 24 tokens left
    assert shape(policy.schedule()) == [("soon", 8), ("later", 24)]


def test_a_decode_with_slack_waits_while_the_budget_is_full_until_its_slo_nears():
    policy, clock = accelgen(options=SLOOptions(**{**OPTIONS.__dict__, "max_budget_tokens": 16}))
    relaxed = import_seq(policy, make_seq("relaxed", 4, tbt_slo_s=2.0))
    policy.add(make_seq("new", 64, start=100, ttft_slo_s=0.05))
    plan = policy.schedule()  # the urgent prompt takes the whole 16-token budget
    assert shape(plan) == [("new", 16)]
    complete(policy, plan)
    clock.now = 1.99  # slack 2 - 1.99 - T_max 0.016 < T_max: urgent now
    assert shape(policy.schedule()) == [("relaxed", 1), ("new", 15)]
    assert relaxed.is_decoding


def test_the_prompt_pool_variant_hands_off_after_the_first_token():
    policy, _ = accelgen(name="accelgen_prompt")
    seq = make_seq("p", 16)
    policy.add(seq)
    complete(policy, policy.schedule())
    assert seq.status.value == "prefilled" and "p" in policy.held


def test_without_a_pivot_time_the_policy_learns_it_from_iterations():
    policy, _ = accelgen(options=SLOOptions(**{**OPTIONS.__dict__, "pivot_time_s": None}))
    assert policy.time_per_token == pytest.approx(0.2 / 64)  # default TBT at the pivot until it learns
    seq = make_seq("s", 64)
    policy.observe(Plan((ScheduledSeq(seq, 64),)), 0.064)
    assert policy.time_per_token == pytest.approx(0.2 / 64 + 0.2 * (0.001 - 0.2 / 64))
    before = policy.time_per_token
    policy.observe(Plan((ScheduledSeq(seq, 16),)), 1.0)  # under half the pivot: fixed costs dominate, ignored
    assert policy.time_per_token == before


@pytest.mark.parametrize("field, value", [("pivot_tokens", 0), ("window_s", -1.0), ("default_tbt_s", float("nan")),
                                          ("max_budget_tokens", 4)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SLOOptions(**{**OPTIONS.__dict__, field: value})
