"""The worker loop under failure (no Ray): a step that raises fails only its requests and the loop
goes on; a failure that leaves the engine unsound makes the loop unhealthy; a stalled step shows
in `health()`; KV leases free what a transfer that never completes holds, on both sides; workers
whose KV layouts differ refuse to exchange KV, naming both.

Reference: the offline engine's greedy tokens (`offline`), and the engine's own integrity check."""
from __future__ import annotations

import time

import pytest

from splitserve.cluster.worker_loop import WorkerUnhealthy
from splitserve.engine import faults
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.transport import IncompatibleKV
from tests.cluster.test_worker_loop import (  # noqa: F401
    FORTY,
    GREEDY,
    LONG,
    SHORT,
    Pair,
    Sink,
    assert_clean,
    offline,
    pair,
    run,
    tokens,
)


@pytest.fixture
def leased():
    pair = Pair(leases={"p0": 0.5, "t0": 0.5})
    yield pair.start()
    pair.close()


def test_a_failed_step_fails_its_requests_and_the_loop_serves_the_next(pair, offline):
    loop = pair.token
    run(loop, faults.fail_next_steps, loop.engine, 1)
    doomed = Sink()
    run(loop, loop.generate, "doomed", SHORT, GREEDY, doomed)
    final = doomed.until_final()[-1]
    assert final.error and "step failed" in final.error and "injected step failure" in final.error
    assert loop.health().healthy and loop.stats.step_failures == 1
    survivor = Sink()
    run(loop, loop.generate, "next", SHORT, GREEDY, survivor)
    assert tokens(survivor.until_final()) == offline(SHORT)
    assert_clean(loop)


def test_a_failed_prefill_cancels_its_transfer_so_the_token_side_frees_its_blocks(pair):
    run(pair.prompt, faults.fail_next_steps, pair.prompt.engine, 1)
    _, prompt_sink, token_sink = pair.disaggregate("r", LONG)
    assert "step failed" in prompt_sink.until_final()[-1].error
    assert "cancelled by the prompt worker" in token_sink.until_final()[-1].error
    assert_clean(pair.prompt)
    assert_clean(pair.token)


def test_a_failure_that_leaves_the_state_unsound_makes_the_loop_unhealthy(pair):
    loop = pair.token
    run(loop, faults.fail_next_steps, loop.engine, 1, True)
    sink = Sink()
    run(loop, loop.generate, "r", SHORT, GREEDY, sink)
    assert sink.until_final()[-1].error
    health = loop.health()
    assert health.alive and not health.healthy and "unsound" in health.reason
    with pytest.raises(WorkerUnhealthy, match="unhealthy"):
        run(loop, loop.generate, "later", SHORT, GREEDY, Sink())
    with pytest.raises(WorkerUnhealthy):
        run(loop, loop.require_healthy)


def test_a_stalled_step_shows_in_health_while_it_runs(pair, offline):
    loop = pair.token
    run(loop, faults.stall_next_step, loop.engine, 1.5)
    sink = Sink()
    run(loop, loop.generate, "slow", SHORT, GREEDY, sink)
    time.sleep(0.8)
    health = loop.health()
    assert health.step_running_s > 0.5 and health.heartbeat_age_s > 0.5
    assert tokens(sink.until_final()) == offline(SHORT)
    assert loop.health().step_running_s == 0


def test_a_reservation_nobody_fills_expires_and_frees_its_blocks(leased):
    token_sink = Sink()
    run(leased.token, leased.token.reserve, "orphan", LONG, GREEDY, "p0", token_sink)  # no prefill is asked for
    final = token_sink.until_final()[-1]
    assert "lease expired" in final.error and "p0" in final.error
    assert leased.token.importer.leases_expired == 1
    assert_clean(leased.token)


def test_a_prefill_still_queued_when_its_lease_ends_is_aborted_on_both_sides(offline):
    # one prompt per prefill (the budget is the first prompt), and no lease on the token side
    pair = Pair(leases={"p0": 0.5}, p0={"prompt_token_budget": len(FORTY)}).start()
    try:
        sinks = {name: (Sink(), Sink()) for name in ("first", "late")}
        tickets = {name: run(pair.token, pair.token.reserve, name, prompt, GREEDY, "p0", sinks[name][1])
                   for name, prompt in (("first", FORTY), ("late", SHORT))}
        run(pair.prompt, faults.stall_next_step, pair.prompt.engine, 1.0)
        pair.prompt.call(time.sleep, 0.2)  # both prefills are queued before the loop steps again
        for name, prompt in (("first", FORTY), ("late", SHORT)):
            pair.prompt.call(pair.prompt.prefill, tickets[name], prompt, GREEDY, sinks[name][0])
        first_prompt, first_token = sinks["first"]
        assert tokens([first_prompt.next()]) + tokens(first_token.until_final())[1:] == offline(FORTY)
        late_prompt, late_token = sinks["late"]
        assert "lease expired" in late_prompt.next().error
        assert "cancelled by the prompt worker" in late_token.until_final()[-1].error
        assert pair.prompt.exporter.leases_expired == 1
        assert_clean(pair.prompt)
        assert_clean(pair.token)
    finally:
        pair.close()


def test_workers_with_different_kv_layouts_refuse_to_transfer_and_name_both():
    pair = Pair(t0={"dtype": "bfloat16"}).start()
    try:
        token_sink = Sink()
        ticket = run(pair.token, pair.token.reserve, "r", LONG, GREEDY, "p0", token_sink)
        with pytest.raises(IncompatibleKV, match=r"worker 'p0' has KV layout \[.*dtype=float32.*\] but worker 't0' "
                                                 r"has \[.*dtype=bfloat16"):
            run(pair.prompt, pair.prompt.prefill, ticket, LONG, GREEDY, Sink())
        assert pair.prompt.engine.num_requests == 0
        # A sender that lies about the layout in the ticket is caught by the receiver's HELLO check.
        forged = type(ticket)(**{**ticket.__dict__, "kv_layout": pair.prompt.exporter.transport.layout})
        run(pair.prompt, pair.prompt.prefill, forged, LONG, GREEDY, Sink())
        error = token_sink.until_final()[-1].error
        assert "worker 't0' has KV layout" in error and "dtype=bfloat16" in error and "'p0'" in error
        assert_clean(pair.token)
    finally:
        pair.close()


def test_a_tiny_temperature_is_greedy(pair, offline):
    sink = Sink()
    run(pair.token, pair.token.generate, "r", SHORT, SamplingParams(max_tokens=10, temperature=1e-300,
                                                                     ignore_eos=True), sink)
    assert tokens(sink.until_final()) == offline(SHORT)
