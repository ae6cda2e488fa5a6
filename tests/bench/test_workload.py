import collections
import dataclasses

import numpy as np
import pytest

from splitserve.bench.traces import repeated_block_fraction
from splitserve.bench.workload import (
    RequestSpec, WorkloadSpec, load_trace, make_workload, parse_priorities, trace_stats,
)


def arrivals(workload):
    return np.array([r.arrival_s for r in workload])


def test_azure_trace_rows_match_the_csv():
    trace = load_trace("code")
    # AzureLLMInferenceTrace_code.csv rows 1-5: 18:17:03.9799600 4808 10, 18:17:04.0319600 3180 8, ...
    assert len(trace) == 8819
    assert trace.prompt_tokens[:5].tolist() == [4808, 3180, 110, 7433, 34]
    assert trace.output_tokens[:5].tolist() == [10, 8, 27, 14, 12]
    assert trace.timestamps_s[:5] == pytest.approx([0.0, 0.052, 0.098189, 0.140684, 0.444994], abs=1e-9)


def test_traces_are_cached_and_read_only():
    trace = load_trace("sharegpt")
    assert load_trace("sharegpt") is trace
    assert trace.timestamps_s is None
    with pytest.raises(ValueError):
        trace.prompt_tokens[0] = 1


def test_trace_stats_match_the_traces_readme():
    code, conv, sharegpt = (trace_stats(load_trace(n)) for n in ("code", "conv", "sharegpt"))
    assert (code["prompt_tokens"]["p50"], code["output_tokens"]["p50"]) == (1469, 13)
    assert (conv["prompt_tokens"]["p99"], conv["output_tokens"]["p90"]) == (4142, 424)
    assert conv["mean_rate_rps"] == pytest.approx(5.53, abs=0.005)
    assert (sharegpt["num_rows"], sharegpt["prompt_tokens"]["p90"], sharegpt["mean_rate_rps"]) == (30731, 5696, None)


def test_trace_arrivals_replay_a_window_of_the_azure_csv():
    # conv rows 2-5 (start_row=1): 18:15:50.9951690 396 109, 51.2224670 879 55, 51.3910170 91 16, 52.5732450 91 16
    workload = make_workload(WorkloadSpec("conv", 4, start_row=1))
    assert [(r.index, r.prompt_tokens, r.output_tokens) for r in workload] == [
        (0, 396, 109), (1, 879, 55), (2, 91, 16), (3, 91, 16)]
    assert arrivals(workload) == pytest.approx([0.0, 0.227298, 0.395848, 1.578076], abs=1e-9)


def test_trace_arrivals_scaled_to_a_rate_keep_relative_gaps():
    own = arrivals(make_workload(WorkloadSpec("conv", 4, start_row=1)))
    scaled = arrivals(make_workload(WorkloadSpec("conv", 4, rate=2.0, arrivals="trace", start_row=1)))
    assert scaled[-1] == pytest.approx(1.5)  # 3 gaps of mean 1 / 2.0 s
    assert scaled[1:] / own[1:] == pytest.approx([0.5 / (1.578076 / 3)] * 3)


def test_sampled_sessions_keep_every_turn_of_the_conversations_they_keep():
    from splitserve.bench.mooncake import conversation_key
    trace = load_trace("mooncake")
    conversations = {}
    for row, blocks in enumerate(trace.prefix_blocks):
        conversations.setdefault(conversation_key(blocks), []).append(row)
    spec = WorkloadSpec("mooncake", 200, session_fraction=0.05, seed=3)
    kept = make_workload(spec)
    keys = {conversation_key(r.prefix_blocks) for r in kept}
    every_turn = sorted(row for key in keys for row in conversations[key])[:200]
    assert [r.prefix_blocks for r in kept] == [trace.prefix_blocks[row] for row in every_turn]
    assert arrivals(kept) == pytest.approx(trace.timestamps_s[every_turn] - trace.timestamps_s[every_turn[0]])
    assert len(keys) < 200 and make_workload(spec) == kept  # several turns each; the seed decides
    assert {conversation_key(r.prefix_blocks) for r in make_workload(WorkloadSpec(
        "mooncake", 200, session_fraction=0.05, seed=4))} != keys
    window = make_workload(WorkloadSpec("mooncake", 200))
    assert repeated(kept) > 0.3 > 0.1 > repeated(window)  # a window cuts most conversations


def repeated(workload) -> float:
    return repeated_block_fraction(r.prefix_blocks for r in workload)


def test_whole_trace_at_a_rate_keeps_its_burstiness():
    own = np.diff(arrivals(make_workload(WorkloadSpec("code", 8819))))
    scaled = np.diff(arrivals(make_workload(WorkloadSpec("code", 8819, rate=5.0, arrivals="trace"))))
    assert scaled.mean() == pytest.approx(0.2)
    assert scaled.std() / scaled.mean() == pytest.approx(own.std() / own.mean())
    assert own.std() / own.mean() > 1.5  # the coding trace is bursty


def test_same_spec_gives_the_same_workload_and_seeds_differ():
    spec = WorkloadSpec("sharegpt", 50, rate=3.0, seed=7)
    first = make_workload(spec)
    assert make_workload(WorkloadSpec("sharegpt", 50, rate=3.0, seed=7)) == first
    assert all(isinstance(r, RequestSpec) and isinstance(r.prompt_tokens, int) for r in first)
    other = make_workload(WorkloadSpec("sharegpt", 50, rate=3.0, seed=8))
    assert [r.prompt_tokens for r in other] != [r.prompt_tokens for r in first]
    assert arrivals(other).tolist() != arrivals(first).tolist()


def test_sampled_lengths_follow_the_trace():
    workload = make_workload(WorkloadSpec("sharegpt", 20_000, rate=1.0))
    # the file's medians (README): prompt 1730, output 415
    assert np.median([r.prompt_tokens for r in workload]) == pytest.approx(1730, rel=0.03)
    assert np.median([r.output_tokens for r in workload]) == pytest.approx(415, rel=0.03)


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_cv_one():
    gaps = np.diff(arrivals(make_workload(WorkloadSpec("arxiv", 20_000, rate=4.0))))
    assert arrivals(make_workload(WorkloadSpec("arxiv", 3, rate=4.0)))[0] == 0.0
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


def test_poisson_is_the_default_when_a_rate_is_given():
    assert make_workload(WorkloadSpec("code", 100, rate=4.0, seed=3)) == make_workload(
        WorkloadSpec("code", 100, rate=4.0, arrivals="poisson", seed=3))


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_arrivals_have_the_asked_burstiness(cv):
    spec = WorkloadSpec("sharegpt", 20_000, rate=2.0, arrivals="gamma", burstiness=cv, seed=1)
    gaps = np.diff(arrivals(make_workload(spec)))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_lengths_are_scaled_rounded_and_clipped():
    # code rows 1-5: prompts 4808 3180 110 7433 34, outputs 10 8 27 14 12; / 8 then clip to [2, 600]
    spec = WorkloadSpec("code", 5, length_scale=1 / 8, max_prompt_tokens=600, min_tokens=2)
    workload = make_workload(spec)
    assert [r.prompt_tokens for r in workload] == [600, 398, 14, 600, 4]  # 601, 397.5 (half to even), 13.75, 929, 4.25
    assert [r.output_tokens for r in workload] == [2, 2, 3, 2, 2]  # 1.25, 1, 3.375, 1.75, 1.5


def test_a_huge_length_scale_clips_to_the_maximum_instead_of_wrapping():
    spec = WorkloadSpec("code", 3, length_scale=1e300, max_prompt_tokens=600)
    assert [(r.prompt_tokens, r.output_tokens) for r in make_workload(spec)] == [(600, 2 ** 62)] * 3


def test_fixed_trace_sends_fixed_lengths():
    workload = make_workload(WorkloadSpec("fixed", 3, rate=1.0, fixed_prompt_tokens=64, fixed_output_tokens=16,
                                          max_output_tokens=10))
    assert [(r.prompt_tokens, r.output_tokens) for r in workload] == [(64, 10)] * 3


def test_csv_paths_in_either_layout(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.5000000,30,3\n"
                     "2024-01-01 00:00:02.0000000,40,4\n2024-01-01 00:01:00.5000000,50,5\n")
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens\n7,2,9\n")
    replay = make_workload(WorkloadSpec(str(azure), 3))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in replay] == [(0.0, 30, 3), (1.5, 40, 4),
                                                                                 (60.0, 50, 5)]
    sampled = make_workload(WorkloadSpec(str(lengths), 2, rate=1.0))
    assert [(r.prompt_tokens, r.output_tokens) for r in sampled] == [(7, 2), (7, 2)]


def test_trace_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="^trace: unknown trace 'chat'"):
        load_trace("chat")
    with pytest.raises(FileNotFoundError, match="^trace: no such file"):
        load_trace(str(tmp_path / "missing.csv"))
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("prompt,output\n1,2\n")
    with pytest.raises(ValueError, match="^trace: .* has columns prompt,output; expected TIMESTAMP"):
        load_trace(str(wrong))


@pytest.mark.parametrize("rows, problem", [
    ("2024-01-01 00:00:00,-3,4", r"column ContextTokens of .* row 1: -3 is not a token count"),
    ("2024-01-01 00:00:00,3,-4", r"column GeneratedTokens of .* row 1: -4 is not a token count"),
    ("2024-01-01 00:00:00,3,100000000000000000000000", r"column GeneratedTokens of .* row 1: 1000* is not a token"),
    ("1700000000,3,4", r"column TIMESTAMP of .* row 1: '1700000000' is not an ISO date-time"),
    ("2024-01-01 00:00:00,3,4\nNaT,3,4", r"column TIMESTAMP of .* row 2: 'NaT' is not an ISO date-time"),
    ("2024-01-01 00:00:00,3,4\n,3,4", r"column TIMESTAMP of .* row 2: '' is not an ISO date-time"),
    pytest.param("2024-01-01 00:00:00,3,4\n" + "x" * 140000 + ",3,4", r"is not valid CSV \(field larger",
                 id="field-too-large"),
])
def test_bad_csv_cells_name_the_column_and_row(tmp_path, rows, problem):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows + "\n")
    with pytest.raises(ValueError, match=f"^trace: .*{problem}"):
        load_trace(str(path))


@pytest.mark.parametrize("field, value", [
    ("num_requests", 0), ("rate", 0.0), ("rate", float("inf")), ("arrivals", "uniform"), ("burstiness", -1.0),
    ("length_scale", 0.0), ("min_tokens", 0), ("max_prompt_tokens", 0), ("max_output_tokens", 0),
    ("fixed_prompt_tokens", 0), ("start_row", -1), ("session_fraction", 0.0), ("session_fraction", 1.5)])
def test_spec_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        WorkloadSpec(**{"trace": "sharegpt", "num_requests": 10, "rate": 1.0, field: value})


@pytest.mark.parametrize("spec, field", [
    (WorkloadSpec("sharegpt", 10), "rate"),                      # length-only trace: no arrivals of its own
    (WorkloadSpec("code", 10, arrivals="gamma"), "rate"),
    (WorkloadSpec("fixed", 10, arrivals="trace"), "arrivals"),
    (WorkloadSpec("arxiv", 10, rate=1.0, arrivals="trace"), "arrivals"),
    (WorkloadSpec("code", 10, start_row=8810), "start_row"),     # rows 8810..8819 run past 8819 rows
    (WorkloadSpec("mooncake", 400, session_fraction=0.01), "start_row"),  # about 120 rows kept
    (WorkloadSpec("conv", 10, session_fraction=0.5), "session_fraction"),  # no conversations to sample
    (WorkloadSpec("mooncake", 10, rate=1.0, session_fraction=0.5), "session_fraction"),  # poisson: no order
])
def test_workloads_the_trace_cannot_give_fail(spec, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make_workload(spec)


def test_adapters_are_drawn_by_zipf_rank_without_changing_the_rest_of_the_workload():
    plain = make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3))
    names = tuple(f"lora-{k}" for k in range(8))
    uniform = make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3, adapters=names))
    skewed = make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3, adapters=names, adapter_zipf=1.5))
    assert {r.adapter for r in plain} == {None}
    for workload in (uniform, skewed):
        assert [dataclasses.replace(r, adapter=None) for r in workload] == plain
    counts = {name: [r.adapter for r in skewed].count(name) for name in names}
    weights = 1 / np.arange(1, 9) ** 1.5
    expected = 4000 * weights / weights.sum()
    assert all(abs(counts[name] - e) < 5 * np.sqrt(e) for name, e in zip(names, expected))  # within 5 sigma
    assert max(collections.Counter(r.adapter for r in uniform).values()) < 4000 / 8 * 1.2


@pytest.mark.parametrize("bad", [dict(adapters=("a", "a")), dict(adapters=("",)), dict(adapter_zipf=-1.0),
                                 dict(adapters=tuple(f"a{i}" for i in range(1025)))])
def test_adapters_are_bounded_and_named(bad):
    with pytest.raises(ValueError, match="adapter"):
        WorkloadSpec("conv", 10, rate=1.0, **bad)


def test_priority_classes_are_drawn_by_their_shares_without_changing_the_rest_of_the_workload():
    plain = make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3, adapters=("a", "b")))
    mixed = make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3, adapters=("a", "b"),
                                       priorities=((0, 0.2), (5, 0.8))))
    assert {r.priority for r in plain} == {0}
    assert [dataclasses.replace(r, priority=0) for r in mixed] == plain
    interactive = sum(r.priority == 0 for r in mixed)
    assert abs(interactive - 800) < 5 * np.sqrt(4000 * 0.2 * 0.8) and {r.priority for r in mixed} == {0, 5}
    assert mixed == make_workload(WorkloadSpec("conv", 4000, rate=5.0, seed=3, adapters=("a", "b"),
                                               priorities=((0, 1.0), (5, 4.0))))  # shares need not sum to 1


def test_priority_mix_parses_and_bad_classes_are_named():
    assert parse_priorities("0:0.2, 1:0.8") == ((0, 0.2), (1, 0.8)) and parse_priorities("") == ()
    for text in ("0", "a:1", "0:x", "0.5:1"):
        with pytest.raises(ValueError, match="--priority-mix"):
            parse_priorities(text)
    for bad in (((0, 1.0), (0, 2.0)), ((0, 0.0),), ((0, float("inf")),), ((2**31, 1.0),),
                tuple((p, 1.0) for p in range(17))):
        with pytest.raises(ValueError, match="priorities"):
            WorkloadSpec("conv", 10, rate=1.0, priorities=bad)
