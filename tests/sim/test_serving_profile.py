"""The serving stack's CPU per request's path and per streamed token, read off a trace of the host's
CPU sampled while groups of requests ran: hand-made traces whose terms are known."""
from dataclasses import replace

import pytest

from splitserve.sim.host_cpu import StackTrace
from splitserve.sim.serving_profile import IDLE_S, stack_cpu
from tests.sim.test_overhead import record

TTFT, GAP, TOKENS = 0.1, 0.01, 5  # each request: first token at 0.1 s, the last at 0.14 s


def groups_at(starts: dict[int, list[float]]) -> dict[int, list]:
    """Per concurrency c, a group of c requests sent together at each of its start times."""
    return {c: [replace(record(32, TTFT, GAP, tokens=TOKENS), start_s=t) for t in times for _ in range(c)]
            for c, times in starts.items()}


def trace_of(groups: dict[int, list], idle_cores: float, path_s: float, token_s: float,
             pause_cores: float = 0.0) -> StackTrace:
    """The stack's CPU sampled every ms: `idle_cores` all along (`pause_cores` more in the pauses
    before groups), each request's path `path_s` spread over its send to first token, and `token_s`
    per token spread over its stream."""
    records = [r for g in groups.values() for r in g]
    spread = [(r.start_s, r.start_s + r.ttft_s, path_s) for r in records]
    spread += [(r.start_s + r.ttft_s, r.start_s + r.e2e_s, token_s * r.output_tokens) for r in records]
    spread += [(t - IDLE_S, t, pause_cores * IDLE_S) for t in {r.start_s for r in records}]
    times = [i / 1000 for i in range(8000)]
    cpu = [idle_cores * t + sum(work * min(1.0, max(0.0, (t - a) / (b - a))) for a, b, work in spread) for t in times]
    return StackTrace(tuple(times), tuple(cpu))


GROUPS = groups_at({1: [1.0, 2.0, 3.0], 2: [4.0, 5.0], 4: [6.0]})  # 11 requests, 55 tokens


def test_the_idle_rate_is_taken_off_and_the_paths_and_tokens_read_apart():
    stack = stack_cpu(trace_of(GROUPS, idle_cores=0.3, path_s=0.03, token_s=0.002), GROUPS)
    assert stack.path_s == pytest.approx(0.03) and (stack.requests, stack.tokens) == (11, 55)
    assert stack.spent_s == pytest.approx(11 * 0.03 + 55 * 0.002)
    assert stack.terms(request_s=0.06) == {"request_cpu_s": pytest.approx(0.03), "stream_cpu_s": pytest.approx(0.002)}


def test_a_paths_cpu_is_at_most_its_time():
    """Measured beyond request_s (the path's time, fitted on TTFTs) it is capped there, and the
    tokens take the rest."""
    stack = stack_cpu(trace_of(GROUPS, idle_cores=0.3, path_s=0.03, token_s=0.002), GROUPS)
    assert stack.terms(request_s=0.02) == {"request_cpu_s": pytest.approx(0.02),
                                           "stream_cpu_s": pytest.approx(0.002 + 11 * 0.01 / 55)}
    assert stack.terms(request_s=0.0)["request_cpu_s"] == 0.0


def test_no_cpu_left_for_the_tokens_says_the_host_was_busy():
    """Other work in the pauses (read as the stack's idle rate) leaves the requests' windows less than none."""
    stack = stack_cpu(trace_of(GROUPS, idle_cores=0.3, path_s=0.03, token_s=0.002, pause_cores=1.0), GROUPS)
    assert stack.path_s < 0 and stack.spent_s < 0
    with pytest.raises(RuntimeError, match="host ran other work while it was measured"):
        stack.terms(request_s=0.06)
