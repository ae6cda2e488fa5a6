"""lm-evaluation-harness against the cluster: its `local-completions` model (the server's own
tokenizer through /tokenize, echo with prompt logprobs, stop strings) runs a loglikelihood task and
a generation task (tests/clients/lm_eval_tasks, local files) to completion, one prompt per request
and in lists of prompts (batch_size 3), and every sample equals the same harness run on the offline
engine (tests/clients/offline_lm.py). The scores are noise."""
from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TASKS = ["splitserve_mc", "splitserve_gen"]
DOCS = 4  # per task


def _refuse_off_machine(host) -> None:
    try:
        local = host in (None, "localhost") or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        local = False
    if not local:
        raise ConnectionRefusedError(f"the lm-eval test reaches only this machine, not {host!r}")


def _only_this_machine(monkeypatch) -> None:
    """Name lookups and TCP connections off this machine raise (the harness must not download)."""
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def local_getaddrinfo(host, *args, **kwargs):
        _refuse_off_machine(host)
        return getaddrinfo(host, *args, **kwargs)

    def local_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _refuse_off_machine(address[0])
        return connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", local_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", local_connect)


@pytest.fixture
def harness(monkeypatch, tmp_path):
    """`simple_evaluate` of lm_eval imported here, with the Hugging Face hub and datasets offline and
    their cache in tmp_path (both read these when imported), run from the repository root (the
    tasks' data_files are relative to it) and only this machine reachable."""
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    _only_this_machine(monkeypatch)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    def run(model, model_args=None, batch_size: int = 1) -> dict:
        tasks = TaskManager(include_path=str(ROOT / "tests/clients/lm_eval_tasks"), include_defaults=False)
        return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size,
                               log_samples=True, task_manager=tasks, bootstrap_iters=0)

    return run


def _responses(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert len(samples) == DOCS
    return [(s["resps"], s["filtered_resps"]) for s in samples]


def test_local_completions_runs_both_tasks_as_on_the_offline_engine(server, offline, harness):
    from tests.clients.offline_lm import OfflineLM  # imports lm_eval: after the harness fixture

    args = {"model": "demo", "base_url": f"{server}/v1/completions", "num_concurrent": 1, "max_retries": 1}
    expected = harness(OfflineLM(offline))
    reference = [choice for resps, _ in _responses(expected, "splitserve_mc") for [choice] in resps]
    assert any(greedy for _, greedy in reference), "no choice is greedy: see splitserve_mc.yaml"
    for batch_size in (1, 3):  # above 1, the harness sends a list of prompts per request
        served = harness("local-completions", args, batch_size)
        scored = [choice for resps, _ in _responses(served, "splitserve_mc") for [choice] in resps]
        assert [greedy for _, greedy in scored] == [greedy for _, greedy in reference]
        assert [ll for ll, _ in scored] == pytest.approx([ll for ll, _ in reference], abs=1e-4)
        assert _responses(served, "splitserve_gen") == _responses(expected, "splitserve_gen")
