"""Async scheduling (`EngineConfig.async_scheduling`): a step queues the next iteration before it
builds its own outputs. On the CPU every op runs as it is queued, so what these tests check is
the order of the work and that nothing changes what a request gets: the same tokens, text,
logprobs and finish reasons as the synchronous engine, whatever ends a request, and the same
clean state after aborts and failures."""
from __future__ import annotations

import pytest

from splitserve.engine import faults
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine, StepFailed
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import ENGINE, PROMPTS, assert_all_free, run_engine
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture)

WAYS_TO_END = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["L", "\x1c\x1c\x1c"], logprobs=1),  # the demo's text has them
    SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, detokenize=False),
    SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, stop_token_ids=[101, 32]),
    SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=3, repetition_penalty=1.3, min_tokens=5),
    SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=0.5, include_stop_str_in_output=True,
                   stop=["\x7f\x7f"]),
]


def _params(i: int) -> SamplingParams:
    return WAYS_TO_END[i % len(WAYS_TO_END)]


class ForwardLog:
    """The sequences each forward ran, and what the engine did in between."""

    def __init__(self, engine: LLMEngine):
        self.events: list[tuple[str, frozenset[str]]] = []
        execute, record = engine.runner.execute, engine._record

        def logged_execute(plan, *args, **kwargs):
            self.events.append(("forward", frozenset(item.seq.seq_id for item in plan.scheduled)))
            return execute(plan, *args, **kwargs)

        def logged_record(req, *args, **kwargs):
            self.events.append(("output", frozenset([req.seq.seq_id])))
            return record(req, *args, **kwargs)

        engine.runner.execute, engine._record = logged_execute, logged_record

    def forwards(self) -> list[frozenset[str]]:
        return [ids for kind, ids in self.events if kind == "forward"]


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "orca", "token"])
def test_every_request_gets_what_the_synchronous_engine_gives_it(policy):
    params = [_params(i) for i in range(len(PROMPTS))]
    engine_args = dict(policy=policy, chunk_token_budget=64, **ENGINE)
    reference = LLM(async_scheduling=False, **engine_args).generate(PROMPTS, params)
    llm = LLM(async_scheduling=True, **engine_args)
    outputs = llm.generate(PROMPTS, params)
    for got, want in zip(outputs, reference):  # the same batches, so the same floats
        assert (got.token_ids, got.outputs[0].text, got.outputs[0].finish_reason, got.outputs[0].logprobs) == \
            (want.token_ids, want.outputs[0].text, want.outputs[0].finish_reason, want.outputs[0].logprobs)
    assert {out.outputs[0].finish_reason for out in outputs} == {"stop", "length"}
    assert_all_free(llm.engine)


def test_the_next_forward_runs_before_this_steps_outputs_are_built():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    log = ForwardLog(engine)
    run_engine(engine, {"a": (PROMPTS[1], _params(0)), "b": (PROMPTS[2], _params(2))})
    kinds = [kind for kind, _ in log.events]
    # each step: the next forward, then the outputs of the one before; the last has no next
    assert kinds[:4] == ["forward", "forward", "output", "output"]
    assert kinds[-3:] == ["forward", "output", "output"]
    assert kinds.count("forward") == 12  # one prefill (both prompts) and 11 decodes: nothing computed twice


def test_a_stop_string_ends_its_request_before_the_next_forward_is_queued():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    log = ForwardLog(engine)
    finished = run_engine(engine, {"stops": (PROMPTS[1], _params(1)), "runs": (PROMPTS[4], _params(0))})
    assert finished["stops"].outputs[0].finish_reason == "stop" and len(finished["stops"].token_ids) < 12
    ran = sum("stops" in ids for ids in log.forwards())
    # one forward per token it got (its prefill gave the first), not one more
    assert ran == len(finished["stops"].token_ids)
    assert_all_free(engine)


def test_an_abort_between_steps_drops_the_request_from_the_iteration_in_flight():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    for request_id, prompt in zip("abc", PROMPTS[1:4]):
        engine.add_request(request_id, prompt, _params(0))
    engine.step()
    engine.step()
    engine.abort("b")  # it is in the iteration the last step queued
    outputs = engine.step()
    assert sorted(out.request_id for out in outputs) == ["a", "c"]
    engine.check_integrity()
    finished = run_engine(engine, {})
    assert sorted(finished) == ["a", "c"] and all(len(out.token_ids) == 12 for out in finished.values())
    assert_all_free(engine)


def test_an_abort_mid_prefill_of_a_request_with_prompt_logprobs_fails_nothing_else():
    engine = LLMEngine(async_scheduling=True, policy="mixed", chunk_token_budget=16, **ENGINE)
    engine.add_request("a", PROMPTS[1][:5], _params(0))
    engine.add_request("b", (PROMPTS[2] * 8)[:100], SamplingParams(max_tokens=4, prompt_logprobs=1))
    engine.step()  # b's next 16-token chunk is in flight
    engine.abort("b")
    assert [out.request_id for out in engine.step()] == ["a"]
    finished = run_engine(engine, {})
    assert list(finished) == ["a"] and len(finished["a"].token_ids) == 12
    assert_all_free(engine)


def test_a_new_request_of_an_aborted_ones_id_gets_only_its_own_prompt_logprobs():
    """The aborted request's chunk in flight is not written into the new one's list (26 entries
    for a 10-token prompt, before the check was by sequence, not by id)."""
    prompt, params = PROMPTS[1][:10], SamplingParams(max_tokens=2, prompt_logprobs=1)
    alone = run_engine(LLMEngine(async_scheduling=True, **ENGINE), {"b": (prompt, params)})["b"]
    engine = LLMEngine(async_scheduling=True, policy="mixed", chunk_token_budget=16, **ENGINE)
    engine.add_request("b", (PROMPTS[2] * 8)[:100], params)
    engine.step()  # its next 16-token chunk is in flight
    engine.abort("b")
    reused = run_engine(engine, {"b": (prompt, params)})["b"]
    assert len(reused.prompt_logprobs) == len(prompt)
    assert reused.prompt_logprobs == pytest.approx(alone.prompt_logprobs)
    assert_all_free(engine)


def test_a_request_added_between_steps_joins_the_iteration_after_the_one_in_flight():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    log = ForwardLog(engine)
    engine.add_request("first", PROMPTS[1], _params(0))
    engine.step()
    engine.add_request("late", PROMPTS[2], _params(0))
    assert "late" not in log.forwards()[-1]
    engine.step()
    assert "late" in log.forwards()[-1]
    finished = run_engine(engine, {})
    assert len(finished["late"].token_ids) == len(finished["first"].token_ids) == 12


def test_a_failure_queuing_the_next_iteration_is_raised_by_the_next_step_and_loses_no_output():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    engine.add_request("a", PROMPTS[1], _params(0))
    engine.step()  # the prefill's token; the first decode is in flight
    faults.fail_next_steps(engine, 1)
    outputs = engine.step()  # returns the first decode's token; queuing the second fails
    assert [len(out.token_ids) for out in outputs] == [2]
    assert engine.has_unfinished_requests()  # so a caller's loop steps again and hears of it
    with pytest.raises(StepFailed) as failure:
        engine.step()
    assert failure.value.request_ids == ["a"] and isinstance(failure.value.cause, faults.InjectedFault)
    finished = run_engine(engine, {"b": (PROMPTS[2], _params(0))})
    assert len(finished["b"].token_ids) == 12
    assert_all_free(engine)


def test_a_step_with_hooks_leaves_nothing_in_flight():
    engine = LLMEngine(async_scheduling=True, **ENGINE)
    log = ForwardLog(engine)
    engine.add_request("a", PROMPTS[1], _params(0))
    seen = []
    while engine.has_unfinished_requests():
        forwards = len(log.forwards())
        engine.step(before_forward=seen.append)
        assert len(log.forwards()) == forwards + 1
    assert len(seen) == 12


def test_the_default_is_on_only_for_cuda():
    assert LLMEngine(**ENGINE).async_scheduling is False
    assert LLMEngine(async_scheduling=True, **ENGINE).async_scheduling is True


@pytest.mark.parametrize("switch_to", ["prefill_first", "token", "orca"])
def test_a_role_switch_with_an_iteration_in_flight_changes_no_tokens(switch_to):
    """The switch may preempt a prompt the in-flight iteration is prefilling (its chunks no longer
    fit the new policy's): it waits for that iteration, and every request still gets its tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for pipelined in (False, True):
        engine = LLMEngine(policy="mixed", chunk_token_budget=16, async_scheduling=pipelined, **ENGINE)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        for _ in range(3):
            engine.step()
        engine.set_policy(switch_to)
        engine.check_integrity()
        finished = run_engine(engine, {})
        got[pipelined] = {request_id: out.token_ids for request_id, out in finished.items()}
        assert_all_free(engine)
    assert got[True] == got[False] and len(got[True]) == len(PROMPTS)


@pytest.mark.gpu
def test_on_cuda_with_graphs_every_request_gets_what_the_synchronous_engine_gives_it():
    """Where it is on by default: decode graphs replay while the host builds outputs, and an abort
    waits on the iteration in flight. Skipped without CUDA."""
    params = [_params(i) for i in range(len(PROMPTS))]
    engine_args = dict(device="cuda", dtype="float32", chunk_token_budget=64, **ENGINE)
    reference = LLM(async_scheduling=False, **engine_args).generate(PROMPTS, params)
    llm = LLM(**engine_args)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    outputs = llm.generate(PROMPTS, params)
    assert [(o.token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs] == \
        [(o.token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in reference]
    engine = llm.engine
    for request_id, prompt in zip("abc", PROMPTS[1:4]):
        engine.add_request(request_id, prompt, _params(0))
    engine.step()
    engine.step()
    engine.abort("b")
    finished = run_engine(engine, {})
    assert sorted(finished) == ["a", "c"]
    assert_all_free(engine)
