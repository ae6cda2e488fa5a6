"""kv_pair.measure's columns from the workers' timestamps (stand-in pairs, no processes): what
layer-wise streaming delays the first token by is the compute thread's packing time on CPU and, on
a GPU, where the host enqueues layers while the device computes, the layered TTFT over the one-shot."""
import sys

import pytest

from tests.scripts.test_bench_gpu import bench_gpu  # noqa: F401 (it imports kv_pair from scripts/)

kv_pair = sys.modules["kv_pair"]  # that module itself: a second copy would break pickling bench_gpu's Pair


class StandIn:
    """Each run's times in seconds: colocated TTFT 0.100; one-shot TTFT 0.101, landed 0.006 after its
    first token; layered TTFT 0.104 with 0.020 of host time streaming, landed 0.001 after."""

    def __init__(self, on_gpu: bool):
        self.label, self.on_gpu = "ipc", on_gpu

    def colocated(self, prompt):
        return 0.100, 0.005

    def disaggregated(self, prompt, threshold):
        ttft, streaming, tail = (0.101, 0.0, 0.006) if threshold == kv_pair.NEVER else (0.104, 0.020, 0.001)
        return {"start": 1.0, "first": 1.0 + ttft, "streaming": streaming, "landed": 1.0 + ttft + tail,
                "second": 1.0 + ttft + tail + 0.005, "sent_bytes": 64}


@pytest.mark.parametrize("on_gpu, visible", [(False, 0.001 + 0.020), (True, 0.001 + 0.003)])
def test_visible_transfer_is_the_tail_plus_what_streaming_delays_the_first_token_by(on_gpu, visible):
    [row] = kv_pair.measure([StandIn(on_gpu)], "demo", 8, 2, 8)
    assert row["serialized_transfer_ms"] == pytest.approx(6.0)
    assert row["tail_ms"] == pytest.approx(1.0) and row["streaming_host_ms"] == pytest.approx(20.0)
    assert row["ttft_ms"] == pytest.approx(104.0) and row["one_shot_ttft_ms"] == pytest.approx(101.0)
    assert row["visible_transfer_ms"] == pytest.approx(visible * 1e3)
    assert row["visible_fraction"] == pytest.approx(visible / 0.006)


def test_on_a_gpu_a_layered_run_faster_than_the_one_shot_adds_no_delay():
    pair = StandIn(True)
    fast = pair.disaggregated
    pair.disaggregated = lambda prompt, threshold: {**fast(prompt, threshold), **(
        {} if threshold == kv_pair.NEVER else {"first": 1.099, "landed": 1.100})}
    [row] = kv_pair.measure([pair], "demo", 8, 1, 8)
    assert row["visible_transfer_ms"] == pytest.approx(1.0)  # the tail alone
