"""Workers sharing a host's cores with the serving stack: processor sharing on hand-computed
timelines, in the host alone and in the simulator."""
import pytest

from splitserve.sim.cluster import simulate
from splitserve.sim.contention import STACK, SharedHost
from splitserve.sim.overhead import ServingOverhead
from tests.sim.test_sim_cluster import spec, split


def timeline(ends):
    return [(run, pytest.approx(t)) for run, t, _ in ends]


def test_an_overlap_slows_both_iterations():
    host = SharedHost(cores=1.0)  # two busy workers each run at half speed
    assert host.start("a", 1.0, now=0.0) == [("a", 1.0, 1)]
    # at 0.5, a has 0.5 s of work left, now at half speed: ends at 1.5; b's 1.0 s at half speed
    ends = host.start("b", 1.0, now=0.5)
    assert timeline(ends) == [("a", 1.5), ("b", 2.5)]
    assert not host.current("a", 1) and host.current("a", ends[0][2])  # a's first end was moved
    # at 1.5 a is done (it took 1.5 s); b did 0.5 s of work and runs its last 0.5 s alone
    elapsed, ends = host.finish("a", now=1.5)
    assert elapsed == pytest.approx(1.5)
    assert timeline(ends) == [("b", 2.0)]
    with pytest.raises(ValueError, match="cores"):
        SharedHost(0.0)


def test_the_stack_streams_the_sampled_tokens_on_the_same_cores():
    host = SharedHost(cores=2.0, stream_cpu_s=0.1)
    host.start("a", 1.0, now=0.0)
    host.start("b", 1.0, now=0.0)
    # a samples 4 tokens: 0.4 s of stack work; b and the stack share 2 cores, each at full speed
    _, ends = host.finish("a", now=1.0, tokens=4)
    assert timeline(ends) == [("b", 1.0), (STACK, 1.4)]
    # a's next iteration makes three runnable threads on two cores: each at 2/3 speed
    ends = host.start("a", 0.2, now=1.0)
    assert timeline(ends) == [("b", 1.0), (STACK, 1.6), ("a", 1.3)]
    _, ends = host.finish("b", now=1.0, tokens=1)  # more for the stack while it has work: it queues
    assert timeline(ends) == [(STACK, 1.5), ("a", 1.2)]


def test_the_simulator_shares_the_host_between_prompt_and_token_workers():
    shared = split(overhead=ServingOverhead(host_cores=1.0))
    requests = [spec(0, 0.0, 100, 4), spec(1, 0.22, 50, 1)]
    first, second = simulate(shared, requests).records
    # request 0 alone: prefill 0.1 (its first token), transfer 0.11, lands at 0.21; decode 0.21-0.23 (0.02 s).
    # At 0.22 request 1's 0.05 s prefill starts: both at half speed. The decode ends at 0.24 and the
    # next (0.24-0.28) and the last (0.28-0.32) run at half speed too; the prefill, 0.01 s done by
    # 0.24 and 0.02 s more by 0.28, ends with its last 0.02 s at 0.32.
    assert first.token_times_s == pytest.approx((0.10, 0.24, 0.28, 0.32))
    assert second.ttft_s == pytest.approx(0.10)
    # workers of their own: the decodes every 0.02 s and the prefill in 0.05 s
    alone = simulate(split(), requests).records
    assert alone[0].token_times_s == pytest.approx((0.10, 0.23, 0.25, 0.27)) and alone[1].ttft_s == pytest.approx(0.05)
    token = simulate(shared, requests).workers[1]
    assert token.worker_id == "token-000" and token.busy_s == pytest.approx(0.03 + 0.04 + 0.04)


def test_the_simulator_charges_the_stack_for_every_token_streamed():
    streamed = split(overhead=ServingOverhead(host_cores=1.0, stream_cpu_s=0.01))
    (record,) = simulate(streamed, [spec(0, 0.0, 100, 4)]).records
    # the prefill's token (at 0.10) gives the stack 0.01 s (0.10-0.11, alone); the KV lands at 0.21. Each
    # decode (0.02 s alone) ends with 0.01 s for the stack, which the next decode shares the core
    # with: 0.23-0.25 at half speed (0.01 done), then alone to 0.26; the same again to 0.29
    assert record.token_times_s == pytest.approx((0.10, 0.23, 0.26, 0.29))


def test_on_a_shared_host_each_requests_path_through_the_stack_is_work_on_its_cores():
    """request_s runs on arrival, before placement: alone it is the plain delay; beside a busy
    worker it shares the core, and the worker slows too."""
    shared = split(overhead=ServingOverhead(host_cores=1.0, request_s=0.02, request_cpu_s=0.02))
    first, second = simulate(shared, [spec(0, 0.0, 100, 4), spec(1, 0.23, 50, 1)]).records
    # request 0 alone: its path 0-0.02, prefill 0.02-0.12 (its first token), the KV lands at 0.23
    # request 1's path (0.23) and the decode 0.23-0.25 share the core: both end at 0.27. Request 1's
    # prefill (0.05 s) then shares it with two decodes (0.27-0.31, 0.31-0.35) and ends alone at 0.36
    assert first.token_times_s == pytest.approx((0.12, 0.27, 0.31, 0.35))
    assert second.ttft_s == pytest.approx(0.36 - 0.23)
    apart = simulate(split(overhead=ServingOverhead(request_s=0.02)), [spec(0, 0.0, 100, 4)]).records[0]
    assert apart.token_times_s == pytest.approx((0.12, 0.25, 0.27, 0.29))  # cores of their own: a plain delay


@pytest.mark.parametrize("request_cpu_s, tokens, ttft", [(0.0, (0.12, 0.25, 0.29, 0.33), 0.11),
                                                          (0.01, (0.12, 0.26, 0.30, 0.34), 0.12)],
                         ids=["all-waiting", "half-cpu"])
def test_only_the_cpu_of_a_requests_path_shares_the_cores(request_cpu_s, tokens, ttft):
    """request_s = its CPU (run first, on the cores) + waiting (off them): the waiting neither slows
    nor is slowed by a decode beside it."""
    shared = split(overhead=ServingOverhead(host_cores=1.0, request_s=0.02, request_cpu_s=request_cpu_s))
    first, second = simulate(shared, [spec(0, 0.0, 100, 4), spec(1, 0.23, 50, 1)]).records
    # all waiting: request 1's path (0.23-0.25) leaves the decode 0.23-0.25 alone; its prefill (0.05 s)
    # shares the core with the decodes 0.25-0.29 and 0.29-0.33 (0.04 done) and ends alone at 0.34.
    # Half CPU: the path's 0.01 shares the core with the decode to 0.25 (the decode ends alone at
    # 0.26), then waits to 0.26; the prefill shares it with the decodes 0.26-0.30, 0.30-0.34, ends at 0.35
    assert first.token_times_s == pytest.approx(tokens)
    assert second.ttft_s == pytest.approx(ttft)
