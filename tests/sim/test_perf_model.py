"""Performance models: the packaged Splitwise profiles, hand-made curves and the iteration rules."""
from __future__ import annotations

import ast
import csv
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.sim import perf_model
from splitserve.sim.perf_model import (DEFAULT_PROFILE, KV_BYTES_PER_TOKEN, MODEL_SHAPES, PerfModel, constant_model,
                                       load_perf_models, load_report)

HARDWARE = ("a100-80gb", "h100-80gb", "h100-80gb-pcap")


@pytest.fixture(scope="module")
def models():
    return load_perf_models()


@pytest.fixture(scope="module")
def csv_rows():
    with DEFAULT_PROFILE.open(newline="") as f:
        return list(csv.DictReader(f))


def three_points() -> PerfModel:
    return PerfModel("m", "hw", 1, (100.0, 200.0, 400.0), (10.0, 20.0, 30.0), (1.0, 2.0, 4.0), (5.0, 6.0, 10.0),
                     reference_context=100.0, decode_context_slope_ms=0.02)


def test_packaged_profiles_cover_the_paper_setups(models):
    for hardware in HARDWARE:
        assert {("llama2-70b", hardware, tp) for tp in (2, 4, 8)} <= set(models)
        assert ("bloom-176b", hardware, 8) in models
    assert len(models) == 12


def test_medians_match_the_csv_rows(models, csv_rows):
    model = models["llama2-70b", "a100-80gb", 8]

    def median(column, match):
        return statistics.median(float(r[column]) for r in csv_rows if r["model"] == "llama2-70b"
                                 and r["hardware"] == "a100-80gb" and r["tensor_parallel"] == "8" and match(r))

    # 2048 prefill tokens: the prompt sweep's 2048 x 1 and the batch sweep's 512 x 4, pooled
    tokens_2048 = median("prompt_time", lambda r: int(r["prompt_size"]) * int(r["batch_size"]) == 2048)
    assert model.prefill_time(2048) * 1000 == pytest.approx(tokens_2048)
    assert 274.2 < tokens_2048 < 292.3  # between the two sweeps' own medians (274.2 and 292.3 ms)
    batch_16 = median("token_time", lambda r: r["batch_size"] == "16")
    assert model.decode_time(16, model.reference_context) * 1000 == pytest.approx(batch_16)
    assert batch_16 == pytest.approx(50.44, abs=0.01)


def test_failed_batch_64_rows_are_left_out(models):
    report = load_report()
    assert report.num_rows == 1260 and len(report.dropped) == 15
    assert {(r.model, r.tensor_parallel, r.batch_size) for r in report.dropped} == {("llama2-70b", 2, 64)}
    assert models["llama2-70b", "a100-80gb", 2].decode_batch[-1] == 32
    assert models["llama2-70b", "a100-80gb", 4].decode_batch[-1] == 64
    # the reference: prompt 512 with 128 output tokens decodes at 512 + 64 context on average
    assert models["llama2-70b", "a100-80gb", 4].reference_context == 576


def test_interpolation_and_extrapolation_by_hand():
    model = three_points()
    assert model.prefill_time(150) == pytest.approx(0.015)
    assert model.prefill_time(300) == pytest.approx(0.025)
    assert model.prefill_time(50) == pytest.approx(0.010)   # flat below the first point
    assert model.prefill_time(600) == pytest.approx(0.040)  # 30 + 200 x (10 / 200) ms
    assert model.decode_time(3, 100) == pytest.approx(0.008)
    assert model.decode_time(8, 100) == pytest.approx(0.018)  # 10 + 4 x (4 / 2) ms
    assert model.decode_time(2, 150) == pytest.approx(0.008)  # 6 + 0.02 x 2 seqs x 50 ms
    assert model.decode_time(1, 0) == pytest.approx(0.003)    # 5 - 0.02 x 100 ms
    assert model.decode_time(2, 0) == pytest.approx(0.003)    # 6 - 4 = 2 ms, clipped at half of 6 ms


def test_a_falling_last_segment_extrapolates_flat():
    model = PerfModel("m", "hw", 1, (1.0, 2.0, 3.0), (10.0, 20.0, 15.0), (1.0,), (5.0,), 0.0, 0.0)
    assert model.prefill_time(30) == pytest.approx(0.015)
    assert model.decode_time(64, 1000) == pytest.approx(0.005)  # one point: flat everywhere


def test_h100_is_faster_than_a100(models):
    for model, tp in [("llama2-70b", 2), ("llama2-70b", 4), ("llama2-70b", 8), ("bloom-176b", 8)]:
        a100, h100 = models[model, "a100-80gb", tp], models[model, "h100-80gb", tp]
        for tokens in (512, 2048, 8192):
            assert h100.prefill_time(tokens) < a100.prefill_time(tokens)
        for batch in (1, 8, 32):
            assert h100.decode_time(batch, 1000) < a100.decode_time(batch, 1000)


def test_power_capped_h100_is_slower_only_in_prefill(models):
    for model, tp in [("llama2-70b", 2), ("llama2-70b", 8), ("bloom-176b", 8)]:
        h100, pcap = models[model, "h100-80gb", tp], models[model, "h100-80gb-pcap", tp]
        for tokens in (128, 1000, 4096, 16384):
            assert pcap.prefill_time(tokens) / h100.prefill_time(tokens) == pytest.approx(1.3, rel=0.01)
        for batch in (1, 5, 32):
            assert pcap.decode_time(batch, 2000) == pytest.approx(h100.decode_time(batch, 2000))
        scaled = h100.scaled(1.3, 1.0, "h100-80gb-pcap")
        assert scaled.hardware == "h100-80gb-pcap"
        assert scaled.prefill_time(3000) == pytest.approx(pcap.prefill_time(3000), rel=0.01)


def test_iteration_time_rules():
    model = constant_model(prefill_ms_per_token=0.5, decode_ms=20.0)
    assert model.iteration_time(0, 0, 0) == 0.0
    assert model.iteration_time(100, 0, 0) == pytest.approx(0.050)
    assert model.iteration_time(0, 10, 5000) == pytest.approx(0.020)
    assert model.iteration_time(100, 10, 5000) == pytest.approx(0.055)  # decodes ride along: 110 tokens
    assert model.iteration_time(2, 10, 5000) == pytest.approx(0.020)    # 12 tokens = 6 ms < the decodes alone
    hand = three_points()
    assert hand.iteration_time(0, 2, 300) == pytest.approx(0.008)       # mean context 150
    # the prefill curve at 150 tokens (15 ms) plus the decodes' attention over 300 context tokens
    assert hand.iteration_time(148, 2, 300) == pytest.approx(0.015 + 0.02 * 300 / 1000)
    chunked = replace(hand, chunk_context_slope_ms=0.001)
    assert chunked.iteration_time(100, 0, 0, 100 * 400) == pytest.approx(0.010 + 0.001 * 40_000 / 1000)
    assert chunked.iteration_time(0, 2, 300, 0) == hand.iteration_time(0, 2, 300)  # no chunk: no chunk term
    with pytest.raises(ValueError, match="chunk_context"):
        chunked.iteration_time(100, 0, 0, -1)


def test_constant_model_arithmetic():
    model = constant_model(0.25, 30.0)
    assert model.prefill_time(1) == pytest.approx(0.00025)
    assert model.prefill_time(1000) == pytest.approx(0.25)
    assert model.decode_time(1, 10) == model.decode_time(256, 100_000) == pytest.approx(0.030)


def test_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="prefill_tokens"):
        PerfModel("m", "hw", 1, (1.0, 2.0), (1.0,), (1.0,), (1.0,), 0.0, 0.0)
    with pytest.raises(ValueError, match="decode_batch"):
        PerfModel("m", "hw", 1, (1.0,), (1.0,), (2.0, 1.0), (1.0, 1.0), 0.0, 0.0)
    with pytest.raises(ValueError, match="decode_context_slope_ms"):
        PerfModel("m", "hw", 1, (1.0,), (1.0,), (1.0,), (1.0,), 0.0, -1.0)
    with pytest.raises(ValueError, match="chunk_context_slope_ms"):
        PerfModel("m", "hw", 1, (1.0,), (1.0,), (1.0,), (1.0,), 0.0, 0.0, math.nan)
    with pytest.raises(ValueError, match="prefill_ms_per_token"):
        constant_model(0.0, 1.0)
    with pytest.raises(ValueError, match="decode_factor"):
        constant_model(1.0, 1.0).scaled(1.0, -2.0, "x")
    with pytest.raises(ValueError, match="num_tokens"):
        constant_model(1.0, 1.0).prefill_time(0)
    bad = tmp_path / "bad.csv"
    bad.write_text("model,hardware,prompt_size\nm,hw,1\n")
    with pytest.raises(ValueError, match="missing columns batch_size, token_size"):
        load_perf_models(bad)
    bad.write_text(",".join(perf_model.CSV_COLUMNS) + "\n" + "x" * 140000 + "\n")
    with pytest.raises(ValueError, match="bad.csv: not valid CSV"):
        load_perf_models(bad)


def test_a_small_profile_by_hand(tmp_path):
    """Prompt sweep 100 / 300 at batch 1 and a batch-2 point at 100, 4 output tokens; one failed row."""
    rows = [(100, 1, 10.0, 2.0), (300, 1, 30.0, 3.0), (100, 2, 18.0, 2.5), (100, 2, 22.0, 2.5),
            (100, 1, 12.0, 2.0)]
    lines = [",".join(perf_model.CSV_COLUMNS)]
    lines += [f"own,cpu,{p},{b},4,0,0,{pt},{tt},{pt + 3 * tt},1" for p, b, pt, tt in rows]
    lines.append("own,cpu,100,2,4,0,0,1.0,1.0,500.0,1")  # e2e 500 ms for 4 ms of iterations
    path = tmp_path / "own.csv"
    path.write_text("\n".join(lines) + "\n")
    model = load_perf_models(path)["own", "cpu", 1]
    assert model.prefill_tokens == (100.0, 200.0, 300.0) and model.prefill_ms == (11.0, 20.0, 30.0)
    assert model.decode_batch == (1.0, 2.0) and model.decode_ms == (2.0, 2.5)
    assert model.reference_context == 102.0                       # prompt 100 + 4 / 2
    assert model.decode_context_slope_ms == pytest.approx(0.005)  # (3 - 2) ms / (302 - 102) tokens
    assert len(load_report(path).dropped) == 1
    assert model.chunk_context_slope_ms == 0.0  # no prefix_size column, as in the Splitwise profiles


def test_the_chunk_slope_is_fitted_on_rows_with_a_prefix(tmp_path):
    """Prompt sweep 100 / 300 (0.1 ms a token); chunks of 100 after 200 and 400 cached tokens take
    4 and 8 ms more: 0.0002 ms per (chunk token x context token). They fit nothing else."""
    rows = [(100, 0, 10.0), (300, 0, 30.0), (100, 200, 14.0), (100, 400, 18.0)]
    lines = [",".join((*perf_model.CSV_COLUMNS, perf_model.PREFIX_COLUMN))]
    lines += [f"own,cpu,{p},1,4,0,0,{pt},2.0,{pt + 6.0},1,{c}" for p, c, pt in rows]
    path = tmp_path / "own.csv"
    path.write_text("\n".join(lines) + "\n")
    model = load_perf_models(path)["own", "cpu", 1]
    assert model.prefill_tokens == (100.0, 300.0) and model.prefill_ms == (10.0, 30.0)
    assert model.chunk_context_slope_ms == pytest.approx(0.0002)
    assert model.scaled(2.0, 1.0, "slow").chunk_context_slope_ms == pytest.approx(0.0004)
    path.write_text("\n".join(lines[:1] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match="every row has a prefix_size"):
        load_perf_models(path)
    path.write_text("\n".join(lines[:2]) + "\n" + lines[1].rsplit(",", 1)[0] + ",-16\n")
    with pytest.raises(ValueError, match="prefix_size must be >= 0"):
        load_perf_models(path)


def test_model_shapes_follow_the_splitwise_simulator():
    assert MODEL_SHAPES["llama2-70b"].num_layers == 80 and MODEL_SHAPES["bloom-176b"].num_layers == 70
    assert KV_BYTES_PER_TOKEN["llama2-70b"] == 2 * 8192 * 80 * 2 == 2_621_440   # 2.62 MB
    assert KV_BYTES_PER_TOKEN["bloom-176b"] == 2 * 14336 * 70 * 2 == 4_014_080  # 4.01 MB


def test_perf_model_does_not_import_torch_or_the_engine():
    tree = ast.parse(Path(perf_model.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "csv", "math", "statistics", "collections", "dataclasses", "itertools", "pathlib",
                        "numpy"}
