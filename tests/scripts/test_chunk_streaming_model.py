"""The chunk-streaming model's rows: a prompt of one chunk streams as it always did; a longer one
leaves no more visible than streaming in its last chunk only, and less where the link is slow."""
import pytest

from splitserve.sim.perf_model import load_perf_models
from tests.scripts.script_runner import load_script


def test_streaming_each_chunk_never_leaves_more_visible_than_the_last_chunk_alone():
    rows = load_script("chunk_streaming_model").main(["--lens", "4096,8192,40000", "--gbps", "400,25"])
    perf = load_perf_models()[("llama2-70b", "h100-80gb", 8)]
    by = {(r["prompt_tokens"], r["gbps"]): r for r in rows}
    for (n, _), row in by.items():
        chunks = [min(8192, n - lo) for lo in range(0, n, 8192)]
        assert row["prefill_s"] == pytest.approx(sum(perf.iteration_time(c, 0, 0, c * 8192 * i)
                                                     for i, c in enumerate(chunks)))
        if len(chunks) == 1:
            assert row["visible_streamed_s"] == row["visible_last_chunk_s"] and row["ttft_ratio"] == 1
        else:
            assert row["visible_streamed_s"] <= row["visible_last_chunk_s"]
    slow = by[40000, 25.0]  # 40k tokens of Llama2-70B KV (13 GB) over 25 Gb/s: the link is the bottleneck
    assert slow["visible_streamed_s"] < 0.5 * slow["visible_last_chunk_s"] and slow["ttft_ratio"] < 1
