"""File and batch expiry (`splitserve/batch/expiry.py`, the store, the service) on a clock the test
moves: OpenAI's policy fields through the official `openai` client; an expired file is gone for
readers at once and from disk at the next sweep, but an active batch's input; a batch whose 24 h
window ends while it runs, or while it waits behind another, expires with its results so far and a
`batch_expired` error for every other line, and stays expired when its finishing was interrupted."""
from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient

from splitserve.api.errors import RequestError
from splitserve.batch import service as service_module
from splitserve.batch.expiry import MAX_S, MIN_S, expiry_seconds
from splitserve.batch.service import BatchService
from splitserve.batch.store import ACTIVE, WINDOW_S, BatchStore, NotFound
from tests.batch.batch_helpers import answered, as_jsonl, batch_lines
from tests.batch.batch_server import make_app

HOUR = 3600


class Clock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class ClockedExecutor:
    """Answers a line a step, moving the clock `step_s` after each; before line `hold_at` it waits
    until the test sets `release`."""

    def __init__(self, clock: Clock, step_s: float, hold_at: int | None = None):
        self.clock, self.step_s, self.hold_at, self.runs = clock, step_s, hold_at, 0
        self.held, self.release = threading.Event(), threading.Event()

    async def run(self, lines, output, errors, options, stop, on_result):
        self.runs += 1

        def steps():
            for number, line in enumerate(lines):
                if number == self.hold_at:
                    self.held.set()
                    self.release.wait(timeout=20)  # bounded: a test failing while it holds still ends
                if stop():
                    return
                if line.custom_id not in output.done and line.custom_id not in errors.done:
                    output.append(answered(line.custom_id))
                    on_result(True)
                    self.clock.now += self.step_s

        await asyncio.to_thread(steps)


def policy(seconds):
    return {"anchor": "created_at", "seconds": seconds}


@pytest.mark.parametrize("given, seconds", [(None, None), (policy(MIN_S), MIN_S), (policy(str(MAX_S)), MAX_S)])
def test_a_policy_gives_its_seconds(given, seconds):
    assert expiry_seconds(given, "expires_after") == seconds


@pytest.mark.parametrize("given, param", [
    ("3600", "expires_after"), ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ({"seconds": 3600}, "expires_after.anchor"), (policy(MIN_S - 1), "expires_after.seconds"),
    (policy(MAX_S + 1), "expires_after.seconds"), (policy(True), "expires_after.seconds"),
    (policy(3600.5), "expires_after.seconds"), (policy("1h"), "expires_after.seconds"),
    (policy("³" * 4), "expires_after.seconds"),
    ({"anchor": "created_at"}, "expires_after.seconds")])
def test_a_bad_policy_is_a_400_naming_its_field(given, param):
    with pytest.raises(RequestError) as bad:
        expiry_seconds(given, "expires_after")
    assert (bad.value.status, bad.value.param) == (400, param)


def wait_until(done, timeout=30):
    for _ in range(int(timeout / 0.01)):
        if done():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_files_expire_as_their_policy_says_through_the_openai_client(tmp_path):
    clock = Clock()
    service = BatchService(BatchStore(tmp_path, clock), ClockedExecutor(clock, step_s=0), file_expiry_s=30 * 24 * HOUR)
    with TestClient(make_app(service)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        upload = client.files.create(file=("in.jsonl", io.BytesIO(as_jsonl(batch_lines(3)))), purpose="batch",
                                     expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
        assert upload.expires_at == upload.created_at + 2 * HOUR
        kept = client.files.create(file=("kept.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert kept.expires_at == kept.created_at + 30 * 24 * HOUR  # the server's default
        with pytest.raises(openai.BadRequestError) as bad:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 60})
        assert bad.value.param == "expires_after.seconds" and "3600" in bad.value.message
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                  output_expires_after={"anchor": "now", "seconds": HOUR})
        assert bad.value.param == "output_expires_after.anchor"
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                      output_expires_after={"anchor": "created_at", "seconds": HOUR})
        assert batch.expires_at == batch.created_at + WINDOW_S
        wait_until(lambda: client.batches.retrieve(batch.id).status == "completed")
        output = client.files.retrieve(client.batches.retrieve(batch.id).output_file_id)
        assert output.expires_at == output.created_at + HOUR and output.purpose == "batch_output"

        clock.now += HOUR  # the output expires; the input has an hour left
        for read in (client.files.retrieve, client.files.content):
            with pytest.raises(openai.NotFoundError):
                read(output.id)
        assert {f.id for f in client.files.list().data} == {upload.id, kept.id}
        http.portal.call(service.sweep)
        assert not (tmp_path / "files" / output.id).exists() and (tmp_path / "files" / upload.id).exists()
        clock.now += HOUR
        http.portal.call(service.sweep)
        assert not (tmp_path / "files" / upload.id).exists() and not (tmp_path / "files" / f"{upload.id}.json").exists()
        assert [f.id for f in client.files.list().data] == [kept.id]
        assert client.batches.retrieve(batch.id).status == "completed"  # a batch object stays


def results(store: BatchStore, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in store.content_path(file_id).read_text().splitlines()] if file_id else []


def test_a_batch_whose_window_ends_while_it_runs_expires_and_keeps_its_input_till_then(tmp_path):
    async def scenario():
        clock = Clock()
        store = BatchStore(tmp_path, clock)
        executor = ClockedExecutor(clock, step_s=HOUR, hold_at=12)  # a line an hour: 24 fit in the window
        service = BatchService(store, executor)
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(40)), "in.jsonl", "batch", policy(HOUR))
        batch_id = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        await asyncio.to_thread(executor.held.wait)
        await service.sweep()  # the input expired 11 hours ago: hidden, but the running batch keeps it
        with pytest.raises(NotFound):
            service.get_file(upload["id"])
        assert (tmp_path / "files" / upload["id"]).exists()
        executor.release.set()
        while store.batch(batch_id)["status"] in ACTIVE:
            await asyncio.sleep(0.01)
        await service.sweep()
        assert not (tmp_path / "files" / upload["id"]).exists()
        await service.stop()
        return store.batch(batch_id), clock.now

    batch, now = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert batch["status"] == "expired" and batch["expired_at"] == int(now) >= batch["expires_at"]
    assert batch["request_counts"] == {"total": 40, "completed": 24, "failed": 16}
    store = BatchStore(tmp_path)
    assert [r["custom_id"] for r in results(store, batch["output_file_id"])] == [f"req-{i}" for i in range(24)]
    expired = results(store, batch["error_file_id"])
    assert [r["custom_id"] for r in expired] == [f"req-{i}" for i in range(24, 40)]
    assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in expired)


def test_a_batch_whose_window_ends_while_it_waits_is_expired_by_the_sweep(tmp_path):
    async def scenario():
        clock = Clock()
        store = BatchStore(tmp_path, clock)
        executor = ClockedExecutor(clock, step_s=0, hold_at=2)
        service = BatchService(store, executor)
        await service.start()
        uploads = [(await service.create_file(as_jsonl(batch_lines(n)), "in.jsonl", "batch"))["id"] for n in (5, 4)]
        running, waiting = [(await service.create_batch(i, "/v1/completions", "24h"))["id"] for i in uploads]
        await asyncio.to_thread(executor.held.wait)
        clock.now += WINDOW_S
        await service.sweep()
        assert store.batch(running)["status"] == "in_progress"  # it expires at its own next step
        executor.release.set()
        while store.batch(running)["status"] in ACTIVE:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the queue hands the waiting batch over: it is no longer active
        await service.stop()
        return store.batch(running), store.batch(waiting), executor.runs

    running, waiting, runs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert runs == 1 and waiting["status"] == running["status"] == "expired"
    assert waiting["request_counts"] == {"total": 4, "completed": 0, "failed": 4} and waiting["output_file_id"] is None
    waiting_errors = results(BatchStore(tmp_path), waiting["error_file_id"])
    assert [r["error"]["code"] for r in waiting_errors] == ["batch_expired"] * 4
    assert running["request_counts"] == {"total": 5, "completed": 2, "failed": 3}


def test_a_batch_expired_before_its_finishing_was_interrupted_is_expired_when_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(service_module, "RERUN_AFTER_S", 0)
    finish, interrupted = BatchService._finish, []

    def interrupted_once(self, batch_id, counts, expired=False):
        if expired and not interrupted:
            interrupted.append(batch_id)
            raise OSError("the server died while finishing")
        finish(self, batch_id, counts, expired)

    monkeypatch.setattr(BatchService, "_finish", interrupted_once)

    async def scenario():
        clock = Clock()
        store = BatchStore(tmp_path, clock)
        service = BatchService(store, ClockedExecutor(clock, step_s=WINDOW_S / 4))
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(10)), "in.jsonl", "batch")
        batch_id = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        while store.batch(batch_id)["status"] in ACTIVE:
            await asyncio.sleep(0.01)
        await service.stop()
        return store.batch(batch_id)

    batch = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert interrupted and batch["status"] == "expired"
    assert batch["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
