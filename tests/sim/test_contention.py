"""Workers sharing a host's cores: processor sharing on hand-computed timelines, in the host alone
and in the simulator, and the fit of the slowdown from a decode crossed with prompts."""
import pytest

from splitserve.bench.report import RequestRecord
from splitserve.sim.cluster import simulate
from splitserve.sim.contention import SharedHost
from splitserve.sim.overhead import ServingOverhead, fit_peer_slowdown
from tests.sim.test_sim_cluster import spec, split


def test_an_overlap_slows_both_iterations():
    host = SharedHost(peer_slowdown=1.0)  # two busy workers each run at half speed
    assert host.start("a", 1.0, now=0.0) == [("a", 1.0, 1)]
    # at 0.5, a has 0.5 s of work left, now at half speed: ends at 1.5; b's 1.0 s at half speed
    ends = host.start("b", 1.0, now=0.5)
    assert [(w, pytest.approx(t)) for w, t, _ in ends] == [("a", 1.5), ("b", 2.5)]
    assert not host.current("a", 1) and host.current("a", ends[0][2])  # a's first end was moved
    # at 1.5 a is done (it took 1.5 s); b did 0.5 s of work and runs its last 0.5 s alone
    elapsed, ends = host.finish("a", now=1.5)
    assert elapsed == pytest.approx(1.5)
    assert [(w, pytest.approx(t)) for w, t, _ in ends] == [("b", 2.0)]
    with pytest.raises(ValueError, match="peer_slowdown"):
        SharedHost(0.0)


def test_the_simulator_shares_the_host_between_prompt_and_token_workers():
    shared = split(overhead=ServingOverhead(peer_slowdown=1.0))
    requests = [spec(0, 0.0, 100, 4), spec(1, 0.22, 50, 1)]
    first, second = simulate(shared, requests).records
    # request 0 alone: prefill 0.1, transfer 0.11, lands at 0.21; decode iteration 0.21-0.23 (0.02 s).
    # At 0.22 request 1's 0.05 s prefill starts: both at half speed. The decode ends at 0.24 and the
    # next (0.24-0.28) and the last (0.28-0.32) run at half speed too; the prefill, 0.01 s done by
    # 0.24 and 0.02 s more by 0.28, ends with its last 0.02 s at 0.32.
    assert first.token_times_s == pytest.approx((0.21, 0.24, 0.28, 0.32))
    assert second.ttft_s == pytest.approx(0.10)
    # workers of their own: the decodes every 0.02 s and the prefill in 0.05 s
    alone = simulate(split(), requests).records
    assert alone[0].token_times_s == pytest.approx((0.21, 0.23, 0.25, 0.27)) and alone[1].ttft_s == pytest.approx(0.05)
    token = simulate(shared, requests).workers[1]
    assert token.worker_id == "token-000" and token.busy_s == pytest.approx(0.03 + 0.04 + 0.04)


def decode_record(gaps, start=0.0):
    times = [0.1]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(0, 16, len(times), len(times), start, times[0], tuple(times), times[-1], status=200)


def prompt_record(start, ttft):
    return RequestRecord(1, 1024, 1, 1, start, ttft, (ttft,), ttft, status=200)


def test_fit_peer_slowdown_compares_gaps_inside_and_outside_the_prompts():
    # 10 ms gaps alone; 15 ms while a prompt is in flight (0.2-0.29 and 0.4-0.49); long gaps after the last
    gaps = [0.01] * 10 + [0.015] * 6 + [0.01] * 5 + [0.015] * 6 + [0.05] * 20
    decode = decode_record(gaps)
    prompts = [prompt_record(0.2, 0.09), prompt_record(0.4, 0.09)]
    assert fit_peer_slowdown(decode, prompts) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="too little"):
        fit_peer_slowdown(decode, [prompt_record(5.0, 0.09)])
