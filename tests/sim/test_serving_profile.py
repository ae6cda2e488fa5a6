"""The serving stack's CPU per streamed token, from its CPU over the requests less their paths."""
import pytest

from splitserve.sim.serving_profile import stream_cpu_per_token
from tests.sim.test_overhead import record


def test_the_stacks_cpu_less_each_requests_path_is_shared_over_the_tokens():
    records = [record(32, 0.05, 0.01, tokens=8), record(64, 0.05, 0.01, tokens=8)]
    # 0.2 s of CPU, 2 requests' paths of 20 ms each, 16 tokens: 10 ms a token
    assert stream_cpu_per_token(0.2, records, 0.02) == pytest.approx(0.01)


@pytest.mark.parametrize("stack_s", [0.04, 0.0, -1.0], ids=["only-the-paths", "none", "less-than-idle"])
def test_no_cpu_left_for_the_tokens_says_the_host_was_busy(stack_s):
    records = [record(32, 0.05, 0.01, tokens=8), record(64, 0.05, 0.01, tokens=8)]
    with pytest.raises(RuntimeError, match="host ran other work while it was measured"):
        stream_cpu_per_token(stack_s, records, 0.02)
