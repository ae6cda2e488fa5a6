"""`splitserve sim`: a deployment's config file or a Splitwise design simulated on a trace, with the bench's
report or its JSON summary."""
from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace

import pytest

from splitserve.bench.workload import WorkloadSpec, make_workload
from splitserve.cli import main
from splitserve.placement import Role
from splitserve.sim.cluster import simulate
from splitserve.sim.designs import DESIGNS, design as design_of
from splitserve.sim.host_kv import HostKVModel
from splitserve.sim.perf_model import CSV_COLUMNS
from splitserve.sim.sim_cli import add_arguments, scenario_of


def write_cpu_profile(path, tensor_parallel: int = 1) -> None:
    """A hand-made `splitserve profile`-style CSV for hardware class cpu: prefill 0.1 ms a token,
    decode 4 ms an iteration growing with the batch."""
    rows = [dict(prompt_size=p, batch_size=1, prompt_time=0.1 * p, token_time=4.0) for p in (32, 128, 512)]
    rows += [dict(prompt_size=128, batch_size=b, prompt_time=0.1 * 128 * b, token_time=4.0 + b) for b in (2, 8, 32)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            e2e = row["prompt_time"] + 15 * row["token_time"]
            writer.writerow({"model": "demo", "hardware": "cpu", "token_size": 16, "peak_power": 0,
                             "average_power": 0, "e2e_time": e2e, "tensor_parallel": tensor_parallel, **row})


def test_a_deploy_file_simulates_into_the_bench_report(tmp_path, capsys):
    out = tmp_path / "ha"
    assert main(["sim", "--config", "deploy/splitwise-ha.yaml", "--trace", "conv", "--rate", "5",
                 "--num-requests", "200", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 200 and summary["num_failed"] == 0
    assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"] and summary["wall_time_s"] > 0
    workers = json.loads((out / "workers.json").read_text())
    assert sorted(w["hardware"] for w in workers) == ["a100", "a100", "h100", "h100"]
    assert {p.name for p in out.iterdir()} >= {"requests.jsonl", "report.md", "latency_cdf.png"}
    assert "simulated in" in capsys.readouterr().out


def test_the_local_cpu_default_with_a_measured_profile(tmp_path):
    profile = tmp_path / "cpu.csv"
    write_cpu_profile(profile)
    out = tmp_path / "cpu"
    assert main(["sim", "--model", "demo", "--tensor-parallel", "1", "--profile", str(profile), "--trace",
                 "sharegpt", "--rate", "2", "--length-scale", "0.05", "--num-requests", "50", "--out", str(out),
                 "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 50 and all(r["output_tokens"] == r["requested_output_tokens"] for r in records)


def test_a_mooncake_trace_simulates_with_its_own_arrivals(tmp_path):
    path = tmp_path / "hh.json"
    assert main(["sim", "--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--trace",
                 "mooncake", "--num-requests", "20", "--length-scale", "0.1", "--no-progress", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["num_requests"] == 20


def test_a_class_without_a_profile_is_a_clear_error(tmp_path, capsys):
    assert main(["sim", "--trace", "conv", "--rate", "1", "--num-requests", "5", "--out", str(tmp_path)]) == 2
    assert "splitserve profile --hardware cpu" in capsys.readouterr().err


def design_args(*extra: str) -> list[str]:
    return ["sim", "--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--trace", "conv",
            "--rate", "2", "--duration", "5", "--no-progress", *extra]


def test_priority_classes_are_reported_each(tmp_path):
    """`--priority-mix` draws each request's class; the summary and the report give each class's
    counts and latencies (with `--scheduling-policy priority`, as the engines would serve them)."""
    out = tmp_path / "classes"
    assert main(design_args("--priority-mix", "0:0.25,1:0.75", "--scheduling-policy", "priority", "--out",
                            str(out))) == 0
    summary = json.loads((out / "summary.json").read_text())
    classes = summary["by_priority"]
    assert list(classes) == ["0", "1"] and sum(c["num_requests"] for c in classes.values()) == 10
    assert all(c["ttft_s"]["p50"] > 0 for c in classes.values() if c["num_completed"])
    assert "| priority | requests |" in (out / "report.md").read_text()
    assert main(design_args("--priority-mix", "0:x", "--json", str(tmp_path / "x.json"))) == 2


def test_a_design_writes_the_machine_readable_summary(tmp_path):
    path = tmp_path / "hh.json"
    assert main(design_args("--json", str(path))) == 0
    summary = json.loads(path.read_text())
    assert summary["num_requests"] == 10 and summary["wall_time_s"] > 0  # 2 req/s for 5 s
    # the same numbers as the library's own run of that design on that workload
    requests = make_workload(WorkloadSpec("conv", 10, rate=2.0, arrivals=None, seed=0, max_prompt_tokens=8192,
                                          max_output_tokens=8192))
    reference = simulate(DESIGNS["splitwise-hh"].scenario(2, 1), requests).summary()
    for metric in ("ttft_s", "tbt_s", "e2e_s"):
        assert summary[metric]["p50"] <= summary[metric]["p90"] <= summary[metric]["p99"]
        assert {p: summary[metric][p] for p in ("p50", "p90", "p99")} == \
            pytest.approx({p: reference[metric][p] for p in ("p50", "p90", "p99")})


def test_a_design_takes_the_decode_rule_and_the_mixed_policy():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--design", "baseline-a100", "--prompt-machines", "3", "--decode-rule", "splitwise-sim",
                              "--mixed-policy", "prefill_first", "--json", "x.json"])
    scenario = scenario_of(args)
    assert scenario.policy_for(Role.MIXED) == "prefill_first" and [p.count for p in scenario.pools] == [3]
    assert type(scenario.perf_models["a100-80gb"]).__name__ == "SplitwiseSimPerf"


@pytest.mark.parametrize("extra, message", [
    (["--design", "splitwise-hh", "--rate", "1", "--json", "x.json"], "--prompt-machines is required"),
    (["--design", "baseline-h100", "--prompt-machines", "2", "--token-machines", "1", "--json", "x.json"],
     "num_token must be 0"),
    (["--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--duration", "5",
      "--json", "x.json"], "--duration needs --rate"),
    (["--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--rate", "1e300",
      "--duration", "1e300", "--json", "x.json"], "--rate x --duration must be a finite number of requests"),
    (["--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1"], "--out"),
    (["--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--kv-host-gib", "-1",
      "--json", "x.json"], "--kv-host-gib must be a finite number >= 0"),
    (["--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "1", "--prefill-saved-weight", "-1",
      "--json", "x.json"], "prefill_saved_weight"),
])
def test_design_mistakes_are_clear_errors(extra, message, capsys):
    assert main(["sim", "--trace", "conv", "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_host_tier_from_the_flags_or_the_config():
    from splitserve.sim.sim_cli import with_host_kv
    design = design_of("splitwise-hh").scenario(1, 1, "llama2-70b")
    design = replace(design, host_kv=HostKVModel(99), pools=(replace(design.pools[0], host_kv_tokens=50),
                                                             *design.pools[1:]))
    per_token = design.transfer.kv_bytes_per_token
    flags = argparse.Namespace(kv_host_gib=None, kv_host_gbps=25.0, kv_host_write_policy=None)
    configured = with_host_kv(flags, design)  # the config's, at the flag's bandwidth
    assert configured.host_kv == HostKVModel(99, 25e9, write_through=True)  # the engine's default policy
    assert configured.host_tokens_of(configured.pools[0]) == 50
    back = with_host_kv(replace_args(flags, kv_host_write_policy="write_back"), design)
    assert back.host_kv == HostKVModel(99, 25e9, write_through=False)
    assert not with_host_kv(flags, back).host_kv.write_through  # the configured policy stands without the flag
    assert with_host_kv(replace_args(flags, kv_host_gib=1.0), replace(design, host_kv=None)).host_kv.write_through
    flagged = with_host_kv(replace_args(flags, kv_host_gib=2.0), design)  # a worker's, whatever its pool's TP
    assert {flagged.host_tokens_of(pool) for pool in flagged.pools} == {2 * 2 ** 30 // per_token}
    assert with_host_kv(replace_args(flags, kv_host_gib=0.0), design).host_kv is None


def test_prefix_placement_from_the_flags_or_the_scenario():
    """Each flag given replaces its field of the scenario's prefix options; none given keeps them."""
    from splitserve.sim.sim_cli import with_prefix
    design = design_of("splitwise-hh").scenario(1, 1, "llama2-70b")
    design = replace(design, prefix=replace(design.prefix, transfer_saved_weight=3.0, max_index_blocks=77))
    flags = argparse.Namespace(prefix_blind=False, prefix_index_blocks=None, prefill_saved_weight=None,
                               transfer_saved_weight=None)
    assert with_prefix(flags, design) is design
    weighted = with_prefix(replace_args(flags, prefill_saved_weight=2.5), design).prefix
    assert (weighted.aware, weighted.prefill_saved_weight, weighted.transfer_saved_weight,
            weighted.max_index_blocks) == (True, 2.5, 3.0, 77)
    every = with_prefix(replace_args(flags, prefix_blind=True, prefix_index_blocks=8, prefill_saved_weight=0.0,
                                     transfer_saved_weight=0.5), design).prefix
    assert (every.aware, every.max_index_blocks, every.prefill_saved_weight, every.transfer_saved_weight) == \
        (False, 8, 0.0, 0.5)


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def test_a_config_and_a_design_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "--config", "deploy/splitwise-ha.yaml", "--design", "splitwise-hh", "--json", "x.json"])
    assert "not allowed with" in capsys.readouterr().err


def test_the_mooncake_trace_simulates_prefix_aware_and_blind(tmp_path):
    summaries = {}
    for flags in ([], ["--prefix-blind"]):
        path = tmp_path / f"{len(flags)}.json"
        assert main(["sim", "--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "2",
                     "--trace", "mooncake", "--num-requests", "300", "--json", str(path), "--no-progress", *flags]) == 0
        summaries[bool(flags)] = json.loads(path.read_text())
    aware, blind = summaries[False], summaries[True]
    assert aware["num_failed"] == blind["num_failed"] == 0
    assert blind["kv_tokens_reused"] == 0 < aware["kv_tokens_reused"]
    assert aware["kv_tokens_sent"] < blind["kv_tokens_sent"]
    assert aware["prefill_tokens_computed"] <= blind["prefill_tokens_computed"]
    tiny = tmp_path / "tiny.json"  # an index of one entry: placement is nearly blind, imports still reuse
    assert main(["sim", "--design", "splitwise-hh", "--prompt-machines", "2", "--token-machines", "2", "--trace",
                 "mooncake", "--num-requests", "300", "--json", str(tiny), "--no-progress",
                 "--prefix-index-blocks", "1"]) == 0
    assert json.loads(tiny.read_text())["num_failed"] == 0


def test_requests_under_lora_adapters_swap_fewer_with_lora_aware_placement(tmp_path):
    """--num-adapters draws each request's adapter; the workers get --max-loras slots (a config
    with none is refused without them); --lora-blind places as if no slot held any."""
    base = ["sim", "--config", "deploy/splitwise-ha.yaml", "--trace", "conv", "--rate", "8", "--num-requests", "300",
            "--num-adapters", "16", "--adapter-zipf", "1", "--lora-swap-ms", "3", "--no-progress"]
    assert main([*base, "--json", str(tmp_path / "none.json")]) == 2  # the config has no slots
    summaries = {}
    for name, flags in (("aware", []), ("blind", ["--lora-blind"])):
        assert main([*base, "--max-loras", "4", *flags, "--json", str(tmp_path / f"{name}.json")]) == 0
        summaries[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert summaries[name]["num_failed"] == 0
    assert 0 < summaries["aware"]["lora_swaps"] < summaries["blind"]["lora_swaps"]
    held = {name: summary["lora_placements"]["held"] for name, summary in summaries.items()}
    assert held["aware"] > held["blind"] > 0  # blind placement records them too
