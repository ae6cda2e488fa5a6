"""The Mooncake trace reader against hand-made lines, and the shipped Mooncake trace."""
import json

import pytest

from splitserve.bench import mooncake
from splitserve.bench.traces import load_trace, repeated_block_fraction, trace_stats


def write_lines(tmp_path, *lines: str, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def line(timestamp=0, input_length=1000, output_length=5, hash_ids=(0, 1), **extra):
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": list(hash_ids), **extra})


def test_good_lines_give_lengths_seconds_and_blocks(tmp_path):
    path = write_lines(tmp_path, line(1500, 1000, 5, (0, 1)), "", line(2000, 1024, 7, (0, 2), extra="kept out"),
                       line(4250.5, 1025, 0, (0, 2, 3)))
    trace = load_trace(path)
    assert trace.prompt_tokens.tolist() == [1000, 1024, 1025]
    assert trace.output_tokens.tolist() == [5, 7, 0]
    assert trace.timestamps_s.tolist() == [0.0, 0.5, 2.7505]
    assert trace.prefix_blocks == ((0, 1), (0, 2), (0, 2, 3))
    assert trace.block_tokens == 512
    assert repeated_block_fraction(trace.prefix_blocks) == pytest.approx(3 / 7)  # 0, 0 and 2 were seen before


@pytest.mark.parametrize("bad, problem", [
    ("not json", "line 2: not a JSON object"),
    ("[1, 2]", "line 2: not a JSON object"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "line 2: missing field hash_ids"),
    (line(timestamp="0"), "line 2: timestamp must be a number"),
    (line(timestamp=True), "line 2: timestamp must be a number"),
    (line(input_length=-1, hash_ids=()), "line 2: input_length must be a non-negative integer below 2\\^63, got -1"),
    (line(output_length=-3), "line 2: output_length must be a non-negative integer below 2\\^63, got -3"),
    (line(output_length=2.5), "line 2: output_length must be a non-negative integer below 2\\^63, got 2.5"),
    (line(output_length=10 ** 22), "line 2: output_length must be a non-negative integer below 2\\^63, got 1"),
    (line(hash_ids=(0, "1")), r"line 2: hash_ids must be a list of integers in \[0, 2\^63\)"),
    (line(hash_ids=(0, -1)), "line 2: hash_ids must be a list"),
    (line(hash_ids=(0, 2 ** 63)), "line 2: hash_ids must be a list"),
    (line().replace("[0, 1]", '"0 1"'), "line 2: hash_ids must be a list"),
    (line(input_length=1025, hash_ids=(0, 1)), r"line 2: input_length 1025 needs 3 hash_ids \(one per 512-token block\), got 2"),
    (line(input_length=512, hash_ids=(0, 1)), r"line 2: input_length 512 needs 1 hash_ids \(one per 512-token block\), got 2"),
    (line(timestamp=-1), "line 2: timestamp -1.0 is before the previous line's 0.0"),
])
def test_bad_lines_name_the_line_and_field(tmp_path, bad, problem):
    path = write_lines(tmp_path, line(), bad, line())
    with pytest.raises(ValueError, match=f"^trace: '.*trace.jsonl' {problem}"):
        load_trace(path)


def test_timestamps_spanning_more_than_a_float_are_refused(tmp_path):
    path = write_lines(tmp_path, line(timestamp=-1e308), line(timestamp=1e308))
    with pytest.raises(ValueError, match="^trace: the timestamps of '.*trace.jsonl' span more milliseconds"):
        load_trace(path)


def test_input_is_bounded(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="has no rows"):
        load_trace(write_lines(tmp_path, "", name="empty.jsonl"))
    monkeypatch.setattr(mooncake, "MAX_LINE_BYTES", 100)
    with pytest.raises(ValueError, match="line 2 is longer than 100 bytes"):
        mooncake.read_mooncake(write_lines(tmp_path, line(), line(hash_ids=range(2), pad="x" * 100)))
    monkeypatch.setattr(mooncake, "MAX_FILE_BYTES", 1 << 20)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"\n" * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="is larger than 1 MiB"):
        mooncake.read_mooncake(str(big))


def test_a_missing_jsonl_path_is_not_a_trace_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="^trace: no such file"):
        load_trace("missing.jsonl")


def test_shipped_mooncake_trace_matches_its_readme():
    trace = load_trace("mooncake")
    stats = trace_stats(trace)
    assert (stats["num_rows"], stats["prompt_tokens"]["p50"], stats["output_tokens"]["p50"]) == (12031, 6909, 350)
    assert stats["mean_rate_rps"] == pytest.approx(3.4, abs=0.005)
    assert trace.prefix_blocks[1][:3] == (0, 14, 15)  # line 2 starts with line 1's first block
    assert stats["repeated_block_fraction"] == pytest.approx(0.37, abs=0.005)  # 0.3664
    assert trace_stats(load_trace("conv"))["repeated_block_fraction"] is None
