"""The simulator's speculative decoding (sim/drafts.py): the per-draft acceptance solved from the
share of drafts kept, its draws, and a worker whose decodes draft through the engine's `speculate`."""
from __future__ import annotations

import argparse
import json

import pytest
import yaml

from splitserve.cli import main
from splitserve.engine.policies import SchedulerLimits
from splitserve.sim.drafts import DraftModel, SimDrafts
from splitserve.sim.sim_cli import add_arguments, scenario_of
from splitserve.sim.worker import FILLER_TOKEN, SimWorker
from tests.sim.test_sim_worker import LinearPerf, request, run_until_idle


@pytest.mark.parametrize("k, share", [(1, 0.3), (4, 0.5), (4, 0.9), (16, 0.05), (4, 0.0), (4, 1.0)])
def test_the_acceptance_gives_the_kept_share_in_expectation_and_in_draws(k, share):
    model = DraftModel(k, share)
    a = model.acceptance
    assert sum(a ** i for i in range(1, k + 1)) / k == pytest.approx(share, abs=1e-12)
    drafts, steps = SimDrafts(model, FILLER_TOKEN, "w0"), 20_000
    kept = sum(drafts.kept(k) for _ in range(steps))
    assert kept / (k * steps) == pytest.approx(share, abs=0.01)
    assert drafts.propose(None, 3) == (FILLER_TOKEN,) * 3


@pytest.mark.parametrize("fields", [(0, 0.5), (17, 0.5), (4, -0.1), (4, 1.5), (4, float("nan")), (2.0, 0.5)])
def test_bad_settings_name_the_field(fields):
    with pytest.raises(ValueError, match="num_speculative_tokens|kept_share"):
        DraftModel(*fields)


def drafting_worker(share: float, k: int = 4, perf=None, **limits):
    times = {}
    worker = SimWorker("w0", "mixed", perf or LinearPerf(), 64, 16, SchedulerLimits(**limits), times,
                       drafts=DraftModel(k, share))
    return worker, times


def test_every_draft_kept_gives_k_plus_one_tokens_a_step_within_max_tokens():
    perf = LinearPerf()
    worker, times = drafting_worker(1.0, perf=perf)
    seq = request(times, "a", 100, 12)
    worker.add(seq, hand_off=False)
    end, _ = run_until_idle(worker)
    # the prefill's token, then 5 a step (4 drafts kept and one more), the last step's drafts cut to max_tokens
    assert [len([t for t in times["a"] if t == when]) for when in sorted(set(times["a"]))] == [1, 5, 5, 1]
    assert seq.output_token_ids == [FILLER_TOKEN] * 12 and seq.finish_reason == "length"
    # a decode with drafts: its drafts chunk tokens over its context; the last one has none left to draft
    assert perf.calls == [(100, 0, 0, 0), (4, 1, 101, 4 * 101), (4, 1, 106, 4 * 106), (0, 1, 111, 0)]
    assert (worker.draft_tokens, worker.accepted_tokens) == (8, 8)
    assert worker.blocks.num_free_blocks == 64


def test_drafts_never_kept_cost_their_checking_and_change_no_token():
    plain, drafted = LinearPerf(), LinearPerf()
    for perf, worker_times in ((plain, None), (drafted, 0.0)):
        if worker_times is None:
            worker, times = SimWorker("w0", "mixed", perf, 64, 16, SchedulerLimits(), {}), None
            times = worker.token_times
        else:
            worker, times = drafting_worker(0.0, perf=perf)
        seq = request(times, "a", 40, 6)
        worker.add(seq, hand_off=False)
        run_until_idle(worker)
        assert len(times["a"]) == 6 and seq.output_token_ids == [FILLER_TOKEN] * 6
    assert len(drafted.calls) == len(plain.calls)  # a token a step, as without drafts
    assert sum(c[0] for c in drafted.calls) > sum(c[0] for c in plain.calls)  # ... and the drafts' rows computed


def test_a_steps_drafts_stay_within_its_token_budget():
    worker, times = drafting_worker(1.0, k=8, max_num_seqs=4, chunk_token_budget=20)
    for i in range(4):
        worker.add(request(times, f"s{i}", 30, 40), hand_off=False)
    now = 0.0
    while (end := worker.start_iteration(now)) is not None:
        assert worker.plan.num_tokens <= 20
        now = end
        worker.finish_iteration(now)
    assert all(len(times[f"s{i}"]) == 40 for i in range(4)) and worker.accepted_tokens > 0


def test_the_cli_simulates_drafts_from_a_kept_share(tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("kept", ["--speculative-tokens", "4", "--draft-kept-share", "0.8"]),
                        ("wasted", ["--speculative-tokens", "4", "--draft-kept-share", "0"])):
        out = tmp_path / name
        assert main(["sim", "--design", "splitwise-hh", "--prompt-machines", "1", "--token-machines", "1",
                     "--num-requests", "40", "--rate", "4", "--no-progress", "--out", str(out), *extra]) == 0
        workers = json.loads((out / "workers.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        runs[name] = summary["e2e_s"]["mean"], summary["draft_tokens"], summary["accepted_tokens"]
        assert runs[name][1:] == (sum(w["draft_tokens"] for w in workers), sum(w["accepted_tokens"] for w in workers))
    assert runs["plain"][1:] == (0, 0)
    assert runs["kept"][2] / runs["kept"][1] == pytest.approx(0.8, abs=0.05)
    assert runs["kept"][0] < runs["plain"][0] < runs["wasted"][0]


def deploy_file_with(tmp_path, engine: dict):
    """deploy/splitwise-ha.yaml with these engine settings."""
    serve = yaml.safe_load(open("deploy/splitwise-ha.yaml"))
    serve["applications"][0]["args"]["engine"].update(engine)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    return path


@pytest.mark.parametrize("engine, extra, message", [
    ({}, ["--speculative-tokens", "4"], "4 speculative tokens a step: give --draft-kept-share"),
    ({}, ["--draft-kept-share", "0.5"], "--draft-kept-share: no speculative decoding"),
    ({"num_speculative_tokens": 3}, [], "3 speculative tokens a step: give --draft-kept-share"),
    ({"num_speculative_tokens": 3}, ["--speculative-tokens", "0", "--draft-kept-share", "0.5"], "no speculative"),
    ({}, ["--speculative-tokens", "4", "--draft-kept-share", "2"], "kept_share must be a number in [0, 1]"),
])
def test_speculation_mistakes_are_clear_errors(tmp_path, capsys, engine, extra, message):
    config = deploy_file_with(tmp_path, engine)
    assert main(["sim", "--config", str(config), "--num-requests", "5", "--no-progress", "--json",
                 str(tmp_path / "x.json"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_configs_speculation_runs_at_the_share_given(tmp_path):
    config = deploy_file_with(tmp_path, {"num_speculative_tokens": 3})
    args = argparse.ArgumentParser()
    add_arguments(args)
    scenario = scenario_of(args.parse_args(["--config", str(config), "--draft-kept-share", "0.6", "--json", "x"]))
    assert scenario.drafts == DraftModel(3, 0.6)
