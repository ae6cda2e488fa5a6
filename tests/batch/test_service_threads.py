"""The service's file work runs in threads: uploads written, a batch's input read and parsed, a
resumed batch's result logs read back, output files read. The event loop (the running batch's
requests, the API's other calls) goes on meanwhile; a cancel that comes while the input is read
ends the batch as a cancel does; uploads are written one at a time, so each checks the room the
ones before it left."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time

from splitserve.api.errors import RequestError
from splitserve.batch import service as service_module
from splitserve.batch.lines import parse_input
from splitserve.batch.results import ResultLog
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from tests.batch.batch_helpers import answered, as_jsonl, batch_lines
from tests.batch.test_service import ThreadExecutor
from tests.loop_ticks import loop_ticks_during


def test_the_event_loop_runs_while_a_large_input_is_parsed(tmp_path):
    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0.05))
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(20_000)), "in.jsonl", "batch")
        creating = asyncio.ensure_future(service.create_batch(upload["id"], "/v1/completions", "24h"))
        start = time.monotonic()
        during = await loop_ticks_during(creating)
        took = time.monotonic() - start
        batch = creating.result()
        await service.stop()
        return batch, during, took

    batch, during, took = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert batch["status"] == "validating" and batch["request_counts"]["total"] == 0
    # parsing inline, the loop ticked not once (20k lines: 0.1 s on a fast core, 0.3 s on a busy one)
    assert took > 0.02 and during >= 5, (took, during)


def test_a_resumed_batchs_logs_are_read_back_off_the_event_loops_thread(tmp_path, monkeypatch):
    """A timed loop cannot tell this apart (the collector's pauses while 20,000 results load are
    as long as the loop's ticks' spread): the thread that reads them is checked instead."""
    store = BatchStore(tmp_path)
    upload = store.add_file(as_jsonl(batch_lines(101)), "in.jsonl", "batch")
    batch = store.new_batch(upload["id"], "/v1/completions", "24h", None)
    output, _ = store.log_paths(batch["id"])
    output.write_bytes(as_jsonl([answered(f"req-{i}") for i in range(100)]))  # a previous owner ran these
    readers = []

    class Log(ResultLog):
        def __init__(self, *args):
            readers.append(threading.current_thread())
            super().__init__(*args)

    monkeypatch.setattr(service_module, "ResultLog", Log)

    async def scenario():
        service = BatchService(store, ThreadExecutor(step_s=0))
        await service.start()  # it resumes the batch
        while store.batch(batch["id"])["status"] != "completed":
            await asyncio.sleep(0.01)
        await service.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert store.batch(batch["id"])["request_counts"] == {"total": 101, "completed": 101, "failed": 0}
    assert len(readers) == 2 and threading.main_thread() not in readers  # asyncio.run's loop is the main thread's


def _parse_held_at(monkeypatch, call: int) -> tuple[threading.Event, threading.Event]:
    """`parse_input` that, at its call-th call, says it is reading and waits to be released."""
    reading, release, calls = threading.Event(), threading.Event(), []

    def held(*args):
        calls.append(args)
        if len(calls) == call:
            reading.set()
            release.wait(10)
        return parse_input(*args)

    monkeypatch.setattr(service_module, "parse_input", held)
    return reading, release


def test_a_cancel_while_the_run_reads_the_input_ends_the_batch_before_any_line_runs(tmp_path, monkeypatch):
    reading, release = _parse_held_at(monkeypatch, 2)  # the run's read, after the creation's

    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0))
        await service.start()
        upload = await service.create_file(as_jsonl(batch_lines(10)), "in.jsonl", "batch")
        batch_id = (await service.create_batch(upload["id"], "/v1/completions", "24h"))["id"]
        assert await asyncio.to_thread(reading.wait, 10)
        cancelling = service.cancel_batch(batch_id)["status"]
        release.set()
        while service.get_batch(batch_id)["status"] != "cancelled":
            await asyncio.sleep(0.01)
        await service.stop()
        return cancelling, service.get_batch(batch_id), service.executor

    cancelling, batch, executor = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert cancelling == "cancelling"  # the run has it: it ends it
    assert not executor.started.is_set() and batch["request_counts"]["completed"] == 0
    assert batch["output_file_id"] is None


def test_a_batch_cancelled_while_its_invalid_input_is_read_at_creation_stays_cancelled(tmp_path, monkeypatch):
    reading, release = _parse_held_at(monkeypatch, 1)

    async def scenario():
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0))
        await service.start()
        upload = await service.create_file(b"{oops\n", "bad.jsonl", "batch")
        creating = asyncio.ensure_future(service.create_batch(upload["id"], "/v1/completions", "24h"))
        assert await asyncio.to_thread(reading.wait, 10)
        (listed,) = service.list_batches()["data"]
        cancelled = service.cancel_batch(listed["id"])["status"]
        release.set()
        created = await creating
        await asyncio.sleep(0.1)  # the queue would have run it by now
        await service.stop()
        return cancelled, created, service.get_batch(listed["id"])

    cancelled, created, batch = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert cancelled == created["status"] == batch["status"] == "cancelled" and batch["errors"] is None


def test_uploads_and_output_reads_run_off_the_event_loops_thread(tmp_path, monkeypatch):
    store = BatchStore(tmp_path)
    writers, readers = [], []
    add_file, content_path = store.add_file, store.content_path

    def written(*args):
        writers.append(threading.current_thread())
        return add_file(*args)

    class ReadPath:
        def __init__(self, path):
            self.path = path

        def read_bytes(self):
            readers.append(threading.current_thread())
            return self.path.read_bytes()

    monkeypatch.setattr(store, "add_file", written)
    monkeypatch.setattr(store, "content_path", lambda *args: ReadPath(content_path(*args)))

    async def scenario():
        service = BatchService(store, ThreadExecutor(step_s=0))
        await service.start()
        upload = await service.create_file(b"{}\n", "in.jsonl", "batch")
        content = await service.file_content(upload["id"])
        await service.stop()
        return content

    assert asyncio.run(scenario()) == b"{}\n"
    assert len(writers) == len(readers) == 1 and threading.main_thread() not in writers + readers


def test_two_uploads_at_once_leave_the_room_the_store_keeps(tmp_path):
    size = 64 << 20

    async def scenario():
        free = shutil.disk_usage(tmp_path).free
        service = BatchService(BatchStore(tmp_path), ThreadExecutor(step_s=0), min_free_bytes=free - 3 * size // 2)
        await service.start()
        uploads = [service.create_file(bytes(size), f"in-{i}.jsonl", "batch") for i in range(2)]
        outcomes = await asyncio.gather(*uploads, return_exceptions=True)
        await service.stop()
        return outcomes

    first, second = asyncio.run(scenario())
    assert first["bytes"] == size  # the second one checked the room only once the first was written
    assert isinstance(second, RequestError) and second.code == "batch_store_full"
