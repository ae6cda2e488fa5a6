"""The batch API over HTTP with the official `openai` client, on a server that is killed (SIGKILL)
in the middle of a batch and started again on the same directory: the batch finishes with every
line exactly once and the outputs an undisturbed engine gives. A second server on a directory
another one owns serves reads, refuses changes, and finishes the batch once the owner stops. A
batch whose run raises is resumed, and failed after the third fault, without stopping the next. An
upload that would leave the store's filesystem short of `min_free_bytes` is refused. Files list in
OpenAI's cursor pages, which the client walks."""
from __future__ import annotations

import asyncio
import io
import shutil
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from splitserve.api.errors import RequestError
from splitserve.batch import service as service_module
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from tests.batch.batch_helpers import LINE_USAGE, answered, as_jsonl, batch_lines, expected_texts
from tests.batch.batch_server import make_app


def start_server(directory, port):
    process = subprocess.Popen([sys.executable, "-m", "tests.batch.batch_server", str(directory), str(port)],
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/batches", timeout=1)
            return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the batch server did not start")


def wait_for(client, batch_id, done, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port():
    return free_port()


def test_round_trip_and_restart_mid_batch(tmp_path, port):
    lines = batch_lines(60, max_tokens=24)
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
           "body": {"model": "other", "prompt": "x"}}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=3, timeout=30)
    server = start_server(tmp_path, port)
    try:
        upload = client.files.create(file=("in.jsonl", io.BytesIO(as_jsonl(lines + [bad]))), purpose="batch")
        assert upload.bytes == len(as_jsonl(lines + [bad])) and upload.purpose == "batch"
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                      metadata={"run": "restart"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "restart"}
        partway = wait_for(client, batch.id, lambda b: b.request_counts.completed >= 10)
        assert partway.status == "in_progress"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    server = start_server(tmp_path, port)
    try:
        batch = wait_for(client, batch.id, lambda b: b.status in ("completed", "failed", "cancelled"))
        assert batch.status == "completed" and batch.request_counts.completed == 60
        assert (batch.request_counts.total, batch.request_counts.failed) == (61, 1)
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        ids = [r["custom_id"] for r in results]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each once: nothing lost or repeated
        got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
        assert got == expected_texts(lines)
        # the batch's usage: its lines', the restarted server's and those it read back from the log
        lines_usage = [openai.types.Completion.model_validate(r["response"]["body"]).usage for r in results]
        assert batch.usage.input_tokens == sum(u.prompt_tokens for u in lines_usage)
        assert batch.usage.output_tokens == sum(u.completion_tokens for u in lines_usage) == 60 * 24 + 12 * 3 * 24
        cached = sum(u.prompt_tokens_details.cached_tokens for u in lines_usage)
        assert batch.usage.input_tokens_details.cached_tokens == cached > 0  # the lines share a prefix
        assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
        [error] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert error["custom_id"] == "bad" and error["response"]["status_code"] == 404
        assert batch.output_file_id in [f.id for f in client.files.list(purpose="batch_output").data]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_a_second_server_on_the_directory_reads_until_the_owner_stops_then_finishes_its_batch(tmp_path, port):
    lines = batch_lines(120, max_tokens=24)
    owner = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=3, timeout=30)
    second_port = free_port()
    second = openai.OpenAI(base_url=f"http://127.0.0.1:{second_port}/v1", api_key="unused", max_retries=0, timeout=30)
    servers = [start_server(tmp_path, port)]
    try:
        servers.append(start_server(tmp_path, second_port))
        upload = owner.files.create(file=("in.jsonl", io.BytesIO(as_jsonl(lines))), purpose="batch")
        batch = owner.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(owner, batch.id, lambda b: b.request_counts.completed >= 5)
        assert second.batches.retrieve(batch.id).status == "in_progress"
        assert second.files.retrieve(upload.id).bytes == len(as_jsonl(lines))
        for change in (lambda: second.files.create(file=("x.jsonl", io.BytesIO(b"")), purpose="batch"),
                       lambda: second.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                     completion_window="24h"),
                       lambda: second.batches.cancel(batch.id), lambda: second.files.delete(upload.id)):
            with pytest.raises(openai.InternalServerError, match="batch.dir") as refused:
                change()
            assert (refused.value.status_code, refused.value.type, refused.value.code) == \
                (503, "service_unavailable", "batch_store_owned")
        partway = owner.batches.retrieve(batch.id)
        assert partway.status == "in_progress" and partway.request_counts.completed < 120
        os.killpg(servers[0].pid, signal.SIGTERM)  # uvicorn stops gracefully, then re-raises the signal
        assert servers[0].wait(timeout=60) == -signal.SIGTERM
        batch = wait_for(second, batch.id, lambda b: b.status in ("completed", "failed", "cancelled"))
        assert batch.status == "completed" and batch.request_counts.completed == 120
        results = [json.loads(x) for x in second.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
        assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results} == expected_texts(lines)
        assert second.files.delete(upload.id).deleted  # the store is the second server's now
    finally:
        for server in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def test_errors_cancel_and_listing(tmp_path, port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    server = start_server(tmp_path, port)
    try:
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_nope")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
        broken = client.files.create(file=("bad.jsonl", io.BytesIO(b"{oops\n")), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            client.batches.create(input_file_id=broken.id, endpoint="/v1/moderations", completion_window="24h")
        failed = client.batches.create(input_file_id=broken.id, endpoint="/v1/completions", completion_window="24h")
        failed = wait_for(client, failed.id, lambda b: b.status == "failed")
        assert failed.errors.data[0].line == 1 and "JSON" in failed.errors.data[0].message
        big = client.files.create(file=("big.jsonl", io.BytesIO(as_jsonl(batch_lines(200, 64)))), purpose="batch")
        running = client.batches.create(input_file_id=big.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(client, running.id, lambda b: b.status == "in_progress")
        assert client.batches.cancel(running.id).status == "cancelling"
        cancelled = wait_for(client, running.id, lambda b: b.status == "cancelled")
        assert cancelled.request_counts.completed < 200
        page = client.batches.list(limit=1)
        assert len(page.data) == 1 and page.has_more
        assert client.files.delete(broken.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(broken.id)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


class ThreadExecutor:
    """Answers a line a step in a thread, as the engine executor runs, checking stop() each step."""

    def __init__(self, step_s: float):
        self.step_s, self.started, self.returned = step_s, threading.Event(), threading.Event()

    async def run(self, lines, output, errors, options, stop, on_result):
        def steps():
            self.started.set()
            for line in lines:
                if stop():
                    break
                time.sleep(self.step_s)
                if line.custom_id not in output.done:
                    output.append(answered(line.custom_id))
                    on_result(True)
            self.returned.set()

        await asyncio.to_thread(steps)


async def cancel_mid_run(service: BatchService, lines: int, after: int) -> tuple[dict, list[bytes]]:
    """A batch of `lines` cancelled once `after` of its results are logged, then the service
    stopped: the batch as it ended, and its output file's lines."""
    upload = await service.create_file(as_jsonl(batch_lines(lines)), "in.jsonl", "batch")
    batch_id = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
    output, _ = service.store.log_paths(batch_id)
    while not output.exists() or output.read_bytes().count(b"\n") < after:
        await asyncio.sleep(0.01)
    service.cancel_batch(batch_id)
    while service.get_batch(batch_id)["status"] != "cancelled":
        await asyncio.sleep(0.01)
    await service.stop()
    batch = service.get_batch(batch_id)
    return batch, (await service.file_content(batch["output_file_id"])).splitlines()


def test_stop_gives_the_store_up_only_once_the_running_batch_has_stopped(tmp_path):
    async def scenario():
        store = BatchStore(tmp_path)
        first = BatchService(store, ThreadExecutor(step_s=0.05))
        await first.start()
        upload = await first.create_file(as_jsonl(batch_lines(40)), "in.jsonl", "batch")
        batch_id = (await first.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        while not first.executor.started.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await first.stop()
        assert first.executor.returned.is_set()  # no write after the store is given up
        stopped = store.batch(batch_id)
        assert stopped["status"] == "in_progress" and 0 < stopped["request_counts"]["completed"] < 40
        second = BatchService(store, ThreadExecutor(step_s=0))
        await second.start()  # owns the store at once and resumes the batch
        while store.batch(batch_id)["status"] != "completed":
            await asyncio.sleep(0.01)
        await second.stop()
        output = store.content_path(store.batch(batch_id)["output_file_id"]).read_text().splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in output) == sorted(f"req-{i}" for i in range(40))

    asyncio.run(asyncio.wait_for(scenario(), 60))


class FaultyExecutor:
    """Answers a batch's first `answer` lines, then raises, `faults` times per batch (keyed by its
    size); a run after those answers every line left."""

    def __init__(self, faults: dict[int, int], answer: int = 2):
        self.faults, self.answer, self.runs = dict(faults), answer, []

    async def run(self, lines, output, errors, options, stop, on_result):
        self.runs.append(len(lines))
        left = [line for line in lines if line.custom_id not in output.done]
        failing = self.faults.get(len(lines), 0) > 0
        for line in left[:self.answer] if failing else left:
            output.append(answered(line.custom_id))
            on_result(True)
        if failing:
            self.faults[len(lines)] -= 1
            raise OSError(f"disk trouble after {len(output.done)} lines")


def test_a_batch_whose_run_raises_is_resumed_then_failed_and_the_next_one_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(service_module, "RERUN_AFTER_S", 0)

    async def scenario(executor, directory):
        service = BatchService(BatchStore(directory), executor)
        await service.start()
        uploads = [(await service.create_file(as_jsonl(batch_lines(n)), "in.jsonl", "batch"))["id"] for n in (9, 5)]
        ids = [(await service.create_batch(i, "/v1/completions", "24h"))["id"] for i in uploads]
        while any(service.get_batch(i)["status"] not in ("completed", "failed") for i in ids):
            await asyncio.sleep(0.01)
        batches = [service.get_batch(i) for i in ids]
        contents = [await service.file_content(b["output_file_id"]) for b in batches]
        outputs = [sorted(json.loads(x)["custom_id"] for x in content.splitlines()) for content in contents]
        await service.stop()
        return batches, outputs

    # two faults: the third run finishes the batch, every line once
    executor = FaultyExecutor({9: 2})
    (first, second), (out_first, out_second) = asyncio.run(asyncio.wait_for(scenario(executor, tmp_path / "a"), 30))
    assert first["status"] == second["status"] == "completed" and executor.runs == [9, 9, 9, 5]
    assert out_first == sorted(f"req-{i}" for i in range(9)) and first["request_counts"]["completed"] == 9
    assert_usage_of_lines(first, 9)  # the lines of three runs, two of them read back from the log
    # three faults: failed, with the lines answered before them as its output; the next batch runs
    executor = FaultyExecutor({9: 3})
    (first, second), (out_first, out_second) = asyncio.run(asyncio.wait_for(scenario(executor, tmp_path / "b"), 30))
    assert first["status"] == "failed" and first["failed_at"] and executor.runs == [9, 9, 9, 5]
    [error] = first["errors"]["data"]
    assert error["code"] == "internal_error" and "OSError: disk trouble after 6 lines" in error["message"]
    assert out_first == sorted(f"req-{i}" for i in range(6))
    assert second["status"] == "completed" and out_second == sorted(f"req-{i}" for i in range(5))
    assert_usage_of_lines(first, 6)  # a failed batch's usage: the lines in its output


def test_a_batch_whose_result_log_is_damaged_fails_with_the_line_at_fault(tmp_path, monkeypatch):
    """Its log is read on each run and raises ValueError: the batch fails with that message and
    the next batch runs (the worker goes on)."""
    monkeypatch.setattr(service_module, "RERUN_AFTER_S", 0)

    async def scenario():
        store = BatchStore(tmp_path)
        upload = store.add_file(as_jsonl(batch_lines(3)), "in.jsonl", "batch")
        damaged, after = (store.new_batch(upload["id"], "/v1/completions", "24h", None)["id"] for _ in range(2))
        output_log = store.log_paths(damaged)[0]
        output_log.write_bytes(as_jsonl([answered("req-0"), [1]]))
        service = BatchService(store, ThreadExecutor(step_s=0))
        await service.start()  # runs the batches the store holds, oldest first
        while service.get_batch(after)["status"] != "completed":
            await asyncio.sleep(0.01)
        await service.stop()
        return store.batch(damaged), output_log

    batch, output_log = asyncio.run(asyncio.wait_for(scenario(), 30))
    [error] = batch["errors"]["data"]
    assert batch["status"] == "failed" and error["code"] == "internal_error"
    assert f"ValueError: {output_log} line 2: not a JSON object with a string custom_id: [1]" in error["message"]


def assert_usage_of_lines(batch: dict, lines: int) -> None:
    """The Batch object's usage, read by the official client, is its output lines' usage summed."""
    usage = openai.types.Batch.model_validate(batch).usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        lines * LINE_USAGE.prompt_tokens, lines * LINE_USAGE.completion_tokens,
        lines * (LINE_USAGE.prompt_tokens + LINE_USAGE.completion_tokens))
    assert usage.input_tokens_details.cached_tokens == lines * LINE_USAGE.cached_tokens
    assert usage.input_tokens_details.cache_write_tokens == lines * LINE_USAGE.cache_write_tokens
    assert usage.output_tokens_details.reasoning_tokens == lines * LINE_USAGE.reasoning_tokens


def test_an_upload_that_would_leave_too_little_free_space_is_refused(tmp_path):
    async def scenario():
        free = shutil.disk_usage(tmp_path).free
        short = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0), min_free_bytes=free + (1 << 40))
        await short.start()
        with pytest.raises(RequestError) as refused:
            await short.create_file(b"{}\n", "in.jsonl", "batch")
        assert (refused.value.status, refused.value.code) == (503, "batch_store_full")
        assert "batch.min_free_bytes" in refused.value.message and short.list_files()["data"] == []
        await short.stop()
        roomy = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0), min_free_bytes=1 << 20)
        await roomy.start()
        assert (await roomy.create_file(b"{}\n", "in.jsonl", "batch"))["bytes"] == 3
        await roomy.stop()

    asyncio.run(scenario())


def test_files_list_in_cursor_pages_the_client_walks(tmp_path):
    service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0))
    with TestClient(make_app(service)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        ids = {client.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch").id for i in range(7)}
        newest_first = [f.id for f in client.files.list().data]
        assert set(newest_first) == ids and not client.files.list().has_more
        first = client.files.list(limit=3)
        assert [f.id for f in first.data] == newest_first[:3] and first.has_more
        assert [f.id for f in client.files.list(after=newest_first[4]).data] == newest_first[5:]
        assert len(list(first.iter_pages())) == 3 and [f.id for f in client.files.list(limit=3)] == newest_first
        assert [f.id for f in client.files.list(limit=2, order="asc")] == newest_first[::-1]
        for query, param in (({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"), ({"order": "up"}, "order"),
                             ({"after": "file-gone"}, "after"), ({"limit": "ten"}, "limit")):
            with pytest.raises(openai.BadRequestError) as bad:
                client.files.list(**query)
            assert bad.value.param == param
