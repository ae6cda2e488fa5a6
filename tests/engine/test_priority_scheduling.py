"""vLLM's priority scheduling (`scheduling_policy: priority`): the waiting queue by (priority,
arrival), the lowest-ranked running sequence preempted first when KV runs out, and a waiting
sequence of a higher priority preempting lower ones it cannot otherwise be admitted past; FCFS
unchanged. An engine's greedy outputs do not depend on the order it serves them in."""
from __future__ import annotations

import pytest

from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import SequenceStatus
from tests.engine.engine_helpers import run_engine
from tests.engine.policy_helpers import import_seq, make, make_seq, shape, step

FCFS_POLICIES = ["mixed", "token", "prompt", "orca", "prefill_first"]


def arrivals(*specs: tuple[str, int]):
    """Sequences named and prioritized as `specs`, arriving in that order."""
    seqs = []
    for at, (seq_id, priority) in enumerate(specs):
        seq = make_seq(seq_id, 5, start=100 * at, priority=priority)
        seq.arrival_time = float(at)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("name", FCFS_POLICIES)
def test_the_waiting_queue_is_by_priority_then_arrival(name):
    p = make(name, max_num_seqs=1, by_priority=True)
    for seq in arrivals(("low", 2), ("a", 0), ("b", 0), ("mid", 1)):
        p.add(seq)
    assert [s.seq_id for s in p.waiting] == ["a", "b", "mid", "low"]
    plan, _ = step(p)
    assert [item.seq.seq_id for item in plan.scheduled] == ["a"]


@pytest.mark.parametrize("name", FCFS_POLICIES)
def test_first_come_first_served_ignores_priorities(name):
    p = make(name, max_num_seqs=1)
    for seq in arrivals(("low", 2), ("a", 0)):
        p.add(seq)
    assert [s.seq_id for s in p.waiting] == ["low", "a"]
    plan, _ = step(p)
    assert [item.seq.seq_id for item in plan.scheduled] == ["low"] and not plan.preempted


@pytest.mark.parametrize("name", ["mixed", "token", "orca", "prefill_first"])
def test_a_higher_priority_preempts_the_lowest_ranked_running_sequence_and_runs_at_once(name):
    """The batch is full: a newcomer of the worst priority running preempts nobody; one of priority
    0 takes the place of the youngest of the worst priority, which goes back to the queue by its rank."""
    p = make(name, max_num_seqs=3, by_priority=True, prompt_chunk_tokens=64)
    old_low, mid, young_low, urgent, peer = arrivals(("old_low", 2), ("mid", 1), ("young_low", 2), ("urgent", 0),
                                                     ("peer", 2))
    for seq in (old_low, mid, young_low):
        p.add(seq)
    step(p)
    p.add(peer)
    plan, _ = step(p)
    assert peer.status is SequenceStatus.WAITING and not plan.preempted  # the lows' equal: no preemption
    p.add(urgent)
    plan, _ = step(p)
    assert plan.preempted == (young_low,) and young_low.status is SequenceStatus.WAITING
    assert urgent.status is SequenceStatus.RUNNING and "urgent" in [item.seq.seq_id for item in plan.scheduled]
    assert [s.seq_id for s in p.waiting] == ["young_low", "peer"]  # back in its place: it came first
    p.check_integrity()


def test_when_kv_runs_out_the_lowest_ranked_decode_goes_not_the_youngest():
    """As test_policies' youngest-first case, by priority: the oldest sequence, of the worst
    priority, is the one preempted."""
    p = make("token", num_blocks=7, prefix=False, by_priority=True)
    a = import_seq(p, make_seq("a", 7, priority=5), first_token=1)
    b = import_seq(p, make_seq("b", 7, start=100), first_token=2)
    c = import_seq(p, make_seq("c", 9, start=200), first_token=3)
    a.arrival_time, b.arrival_time, c.arrival_time = 0.0, 1.0, 2.0
    step(p)
    plan, _ = step(p)
    assert plan.preempted == (a,) and shape(plan) == [("b", 1), ("c", 1)]
    assert a.status is SequenceStatus.WAITING and list(p.waiting) == [a]
    p.check_integrity()


def test_the_accelgen_policies_refuse_priorities_and_the_name_is_checked():
    with pytest.raises(ConfigError, match="accelgen policy orders requests by their latency targets"):
        EngineConfig(policy="mixed", switch_policies=("accelgen",), scheduling_policy="priority")
    with pytest.raises(ConfigError, match="scheduling_policy must be fcfs or priority"):
        EngineConfig(scheduling_policy="lifo")
    assert EngineConfig(scheduling_policy="priority").scheduler_limits(64).by_priority


def test_a_priority_needs_priority_scheduling_and_is_bounded():
    engine = LLMEngine(max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="priority: this engine schedules first come, first served"):
        engine.add_request("a", [1, 2, 3], SamplingParams(priority=-1))
    engine.add_request("b", [1, 2, 3], SamplingParams(priority=0))
    for bad in (2**31, 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            SamplingParams(priority=bad)


def test_an_engine_serving_by_priority_gives_each_request_its_own_greedy_output():
    """A cache too small for every request at once: urgent ones overtake and preempt, and each
    output still equals what the request gives alone in an FCFS engine."""
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {f"r{i}": ([1 + i] + list(range(40, 40 + 9 + 3 * i)), (i * 7) % 3 - 1) for i in range(8)}
    alone = {}
    for request_id, (prompt, _) in prompts.items():
        alone.update(run_engine(LLMEngine(max_model_len=64, num_kv_blocks=16),
                                {request_id: (prompt, SamplingParams(**greedy))}))
    engine = LLMEngine(max_model_len=64, num_kv_blocks=6, max_num_seqs=4, scheduling_policy="priority")
    got = run_engine(engine, {request_id: (prompt, SamplingParams(priority=priority, **greedy))
                              for request_id, (prompt, priority) in prompts.items()})
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in alone.items()}
    assert engine.policy.num_preemptions > 0
