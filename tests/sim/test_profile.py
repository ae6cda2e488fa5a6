"""`splitserve profile`: the real engine measured into a CSV the performance models load."""
from __future__ import annotations

import pytest

from splitserve.cli import main
from splitserve.sim.perf_model import load_perf_models
from splitserve.sim.profile import ProfileSpec, run_profile, write_csv


def test_a_tiny_profile_loads_as_a_perf_model(tmp_path):
    spec = ProfileSpec(prompt_sizes=(16, 256), batch_sizes=(1, 4), repeats=3, token_size=4, chunk_size=64,
                       chunk_contexts=(256, 512))
    result = run_profile(spec)
    assert len(result.rows) == 3 * 6  # (16, 1), (256, 1) | (256, 1), (256, 4) | 64 after 256, 512; three times
    assert [(r["prompt_size"], r["prefix_size"]) for r in result.rows[4:6]] == [(64, 256), (64, 512)]
    assert all(r["e2e_time"] == pytest.approx(r["prompt_time"] + 3 * r["token_time"]) for r in result.rows)
    assert result.shape.num_layers == 4
    assert result.shape.kv_bytes_per_token == 2 * 4 * 4 * 32 * 4  # K and V, layers, kv heads, head dim, float32
    models = load_perf_models(write_csv(result.rows, tmp_path / "demo.csv"))
    model = models["demo", "cpu", 1]
    assert model.prefill_tokens == (16.0, 256.0, 1024.0)
    assert all(t > 0 for t in model.prefill_ms)
    assert list(model.prefill_ms) == sorted(model.prefill_ms)
    assert model.decode_batch == (1.0, 4.0) and model.reference_context == 258.0
    assert model.tensor_parallel == 1
    assert model.chunk_context_slope_ms > 0  # a chunk attending over more cached tokens takes longer


def test_reference_prompt_and_sweep_points():
    assert ProfileSpec().reference_prompt == 512
    assert ProfileSpec(prompt_sizes=(100, 600, 300)).reference_prompt == 300
    assert ProfileSpec(prompt_sizes=(600, 700)).reference_prompt == 600
    assert ProfileSpec(prompt_sizes=(64, 32), batch_sizes=(4, 1)).points() == [(32, 1), (64, 1), (64, 1), (64, 4)]
    assert ProfileSpec(prompt_sizes=(64,), chunk_size=100, chunk_contexts=(1024,), token_size=8).longest() == 1132
    with pytest.raises(ValueError, match="chunk_contexts must be positive multiples of 16"):
        ProfileSpec(chunk_contexts=(100,))


def test_cli_writes_the_csv_and_a_table(tmp_path, capsys):
    out = tmp_path / "p.csv"
    code = main(["profile", "--out", str(out), "--prompt-sizes", "16,48", "--batch-sizes", "1,2", "--repeats", "1",
                 "--token-size", "3", "--chunk-size", "32", "--chunk-contexts", "16,64"])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"wrote 6 rows to {out}" in printed and "| 48 | 2 | 0 | 1 |" in printed and "| 32 | 1 | 64 | 1 |" in printed
    assert set(load_perf_models(out)) == {("demo", "cpu", 1)}
    assert main(["profile", "--out", str(out), "--prompt-sizes", "16", "--batch-sizes", "1", "--repeats", "1",
                 "--token-size", "3", "--chunk-contexts", "none"]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--help"])
    assert exit_info.value.code == 0
    assert "--prompt-sizes" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--prompt-sizes", "0"), ("--batch-sizes", "1,x"), ("--repeats", "2,3")])
def test_cli_rejects_bad_arguments(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--out", str(tmp_path / "p.csv"), flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--token-size", "1"], "token_size must be >= 2"),
                                           (["--prompt-sizes", "2040", "--token-size", "16"], "max_model_len=2048")])
def test_cli_reports_impossible_profiles(tmp_path, capsys, args, message):
    out = tmp_path / "p.csv"
    assert main(["profile", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
