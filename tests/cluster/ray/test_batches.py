"""The batch API of a real local cluster through the official `openai` client: upload, create,
poll, download; greedy results equal the offline engine's; a bad line lands in the error file; a
line with any option of its endpoint (choices, several prompts, logprobs, echo, structured output,
tools; embeddings' inputs and dimensions) is answered as the endpoint answers it, and as a batch on
the offline engine does; the batch actor runs on the head node, where `batch.dir` is; expiration
policies reach it."""
from __future__ import annotations

import io
import json
import math
import time

import httpx
import openai
import pytest
from ray.util.state import list_actors, list_nodes

from splitserve import SamplingParams
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.engine_executor import run_lines
from splitserve.batch.lines import parse_input
from splitserve.batch.results import ResultLog
from splitserve.cluster.app import HEAD_NODE
from splitserve.cluster.controller import WORKER_NAMESPACE
from tests.batch.batch_helpers import FAILING, as_jsonl, comparable, option_lines


@pytest.mark.parametrize("name", ["main-batches", "main-responses"])  # their files are the head node's
def test_the_batch_actor_and_the_response_store_are_placed_on_the_head_node(server, name):
    [actor] = list_actors(filters=[("name", "=", name), ("ray_namespace", "=", WORKER_NAMESPACE)],
                          detail=True)
    [head] = list_nodes(filters=[("is_head_node", "=", True)])
    assert actor.required_resources.get(HEAD_NODE) and actor.node_id == head.node_id


PROMPTS = ["Shared system prompt. " * 4 + f"Question {i}?" for i in range(6)]


def test_batch_round_trip_through_the_cluster(client, offline):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "demo", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}}
             for i, p in enumerate(PROMPTS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "demo", "prompt": "x", "max_tokens": 0}})
    batch = finished(client, submit(client, lines, "/v1/completions", {"anchor": "created_at", "seconds": 7200}))
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200 and batch.expires_at == batch.created_at + 24 * 3600
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 6, 1)
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    assert got == {f"q{i}": out.text for i, out in enumerate(expected)}
    usage = batch.usage  # the six lines' usage; the 400 computed nothing
    assert (usage.input_tokens, usage.output_tokens) == (sum(len(out.prompt_token_ids) for out in expected), 36)
    error = json.loads(client.files.content(batch.error_file_id).text)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]


def test_lines_with_every_option_are_answered_as_their_endpoint_answers(client, server, offline, tmp_path):
    groups = option_lines()
    batches = {endpoint: submit(client, lines, endpoint) for endpoint, lines in groups.items()}
    got = {}
    for endpoint, batch in batches.items():
        batch = finished(client, batch)
        failed = sum(line["custom_id"] in FAILING for line in groups[endpoint])
        assert (batch.request_counts.completed, batch.request_counts.failed) == (len(groups[endpoint]) - failed, failed)
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                got.update((r["custom_id"], r["response"]) for r in map(json.loads, client.files.content(file_id).text
                                                                        .splitlines()))
    with ResultLog(tmp_path / "out.jsonl") as output, ResultLog(tmp_path / "errors.jsonl") as errors:
        all_lines = [line for lines in groups.values() for line in lines]
        run_lines(offline.engine, parse_input(as_jsonl(all_lines)), "demo", output, errors, BlendOptions("dfs"))
        on_engine = {custom_id: r["response"] for custom_id, r in {**output.done, **errors.done}.items()}
    for line in all_lines:
        answer = httpx.post(f"{server}{line['url']}", json=line["body"], timeout=120)
        batched, engine_batched = got[line["custom_id"]], on_engine[line["custom_id"]]
        assert batched["status_code"] == engine_batched["status_code"] == answer.status_code, line["custom_id"]
        assert_close(comparable(batched["body"]), comparable(answer.json()), line["custom_id"])
        assert_close(comparable(engine_batched["body"]), comparable(answer.json()), line["custom_id"])


def assert_close(got, expected, where: str) -> None:
    """Equal, but for floats (logprobs) within 1e-4: the lines ran batched with each other."""
    if isinstance(expected, float):
        assert math.isclose(got, expected, abs_tol=1e-4), (where, got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), (where, got, expected)
        for key in expected:
            assert_close(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), (where, got, expected)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_close(a, b, f"{where}[{i}]")
    else:
        assert got == expected, (where, got, expected)


def submit(client, lines: list[dict], endpoint: str, expires_after=openai.omit):
    """The batch of `lines`; `expires_after`: the policy of its input and of its output files."""
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(as_jsonl(lines))), purpose="batch",
                                 expires_after=expires_after)
    if expires_after is not openai.omit:
        assert upload.expires_at == upload.created_at + expires_after["seconds"]
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"job": "test"}, output_expires_after=expires_after)


def finished(client, batch, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.status, batch.errors)
    return batch
