"""The batch API's behaviour (files, batches, their lifecycle), independent of HTTP and of where
requests run. One batch runs at a time, in creation order. One server at a time owns a store
(`StoreLock`); the owner resumes the batches a previous one left active, from their result logs. A
server that finds the store owned serves reads, refuses changes with 503 and takes the store over
when the owner stops.

Lifecycle: validating -> in_progress -> finalizing -> completed, or failed (the input file is
invalid, or its run raised RUNS_PER_BATCH times: results so far are kept in its files), or
cancelling -> cancelled (results so far are kept in the output file), or expired (its 24 h window
ended first: results so far are kept, the other lines are `batch_expired` errors).

Files expire as their policy says (`expires_after`, `output_expires_after`, else the server's
default): the owner removes them every SWEEP_EVERY_S, but an active batch's input, which it reads
again when resumed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from splitserve.api.cursor_page import cursor_page, in_order
from splitserve.api.errors import RequestError
from splitserve.api.limits import RequestLimits
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.expiry import expiry_seconds
from splitserve.batch.lines import ENDPOINTS, BatchLine, InputFileError, expired_line, parse_input
from splitserve.batch.results import ResultLog
from splitserve.batch.store import ACTIVE, PURPOSES, BatchStore
from splitserve.batch.store_lock import StoreLock
from splitserve.batch.usage import BatchUsage

TAKE_OVER_EVERY_S = 2.0  # how often a server that finds the store owned tries again
RUNS_PER_BATCH = 3  # a batch whose run raises is resumed from its logs until it has raised this often
RERUN_AFTER_S = 5.0  # between those runs
SAVE_EVERY_S = 0.5  # a running batch's counts and usage are saved at most this often, and when its run returns
SWEEP_EVERY_S = 60.0  # how often the owner expires waiting batches past their window and removes expired files
WAITING = ("validating", "in_progress")  # a batch in the queue, or the running one
MAX_FILES_PAGE, MAX_BATCHES_PAGE = 10_000, 100  # OpenAI's bounds on a list's `limit` (and the files' default)
log = logging.getLogger(__name__)


class Executor(Protocol):
    async def run(self, lines: list[BatchLine], output: ResultLog, errors: ResultLog, options: BlendOptions,
                  stop: Callable[[], bool], on_result: Callable[[bool], None]) -> None:
        """Run every line without a result in either log, appending each result as it ends."""


class BatchService:
    def __init__(self, store: BatchStore, executor: Executor, options: BlendOptions = BlendOptions(),
                 max_lines: int = RequestLimits.max_batch_lines, min_free_bytes: int = 0,
                 file_expiry_s: int | None = None):
        """`file_expiry_s`: how long a file without an expiration policy is kept (None: until deleted)."""
        self.store, self.executor, self.options, self.max_lines = store, executor, options, max_lines
        self.min_free_bytes, self.file_expiry_s = min_free_bytes, file_expiry_s
        self._queue: asyncio.Queue[str] | None = None
        self._cancelled: set[str] = set()
        self._running: str | None = None
        self._worker: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._lock = StoreLock(store.root)
        self._uploads = asyncio.Lock()  # one upload written at a time: each checks the room the one before left
        self._stopping = False

    async def start(self) -> None:
        """Begin running batches, now if this server can own the store, else once its owner stops."""
        self._queue = asyncio.Queue()
        owned = self._take_over()
        if not owned:
            log.warning("batch store %s is owned by another server: its batch API answers reads only until "
                        "that server stops", self.store.root)
        self._worker = asyncio.create_task(self._run_all(owned))
        self._sweeper = asyncio.create_task(self._sweep_every())

    async def stop(self) -> None:
        """Stop running batches and give the store up. A running batch stops at its executor's next
        step, its results so far kept in its logs for the next owner; the lock goes only after the
        executor has returned, so two servers never write one store."""
        self._stopping = True
        for task in (self._sweeper, self._worker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._lock.release()

    def _take_over(self) -> bool:
        """Own the store and queue the batches a previous owner left active (oldest first); False
        while another server owns it. Nothing queues a batch before this returns True."""
        if not self._lock.try_acquire():
            return False
        for batch in reversed(self.store.batches()):
            if batch["status"] in ACTIVE:
                self._queue.put_nowait(batch["id"])
        return True

    def _check_owner(self) -> None:
        if not self._lock.held:
            raise RequestError(f"the batch store {self.store.root} is owned by another server (another splitserve on "
                               "the same batch.dir, or the previous cluster during an upgrade): this one serves reads "
                               "only, and takes the store over when that server stops", status=503,
                               type="service_unavailable", code="batch_store_owned")

    # ---- files ---------------------------------------------------------------------------
    async def create_file(self, content: bytes, filename: str, purpose: str,
                          expires_after: dict | None = None) -> dict:
        """Written and synced in a thread (an upload of 200 MB takes seconds), off the event loop."""
        self._check_owner()
        if purpose != "batch":
            raise RequestError(f"purpose must be 'batch' (this server runs batches only), got {purpose!r}",
                               param="purpose")
        expires_after_s = expiry_seconds(expires_after, "expires_after")
        async with self._uploads:
            free = shutil.disk_usage(self.store.root).free
            if free - len(content) < self.min_free_bytes:
                raise RequestError(f"the batch store's filesystem has {free} bytes free; this upload of "
                                   f"{len(content)} would leave less than batch.min_free_bytes "
                                   f"({self.min_free_bytes}), which running batches keep for their results: delete "
                                   "files (DELETE /v1/files/{id}) or give the store more room", status=503,
                                   type="service_unavailable", code="batch_store_full")
            return await asyncio.to_thread(self.store.add_file, content, filename, purpose,
                                           self._or_default(expires_after_s))

    def list_files(self, purpose: str | None = None, limit: int | None = None, after: str | None = None,
                   order: str = "desc") -> dict:
        """A page of the files (`limit`: at most 10,000, the default), newest first (`order` "asc":
        oldest first), after the file `after`."""
        if purpose is not None and purpose not in PURPOSES:
            raise RequestError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
        files = in_order(self.store.files(purpose), order)
        return cursor_page(files, MAX_FILES_PAGE if limit is None else limit, after, MAX_FILES_PAGE)

    def get_file(self, file_id: str) -> dict:
        return self.store.file(file_id)

    async def file_content(self, file_id: str) -> bytes:
        """Read in a thread: an output file can hold 50,000 results."""
        return await asyncio.to_thread(self.store.content_path(file_id).read_bytes)

    def delete_file(self, file_id: str) -> dict:
        """Refused (409) for the input of an active batch, which reads it again when resumed."""
        self._check_owner()
        users = [b for b in self.store.batches() if b["status"] in ACTIVE and b["input_file_id"] == file_id]
        if users:
            raise RequestError(f"file {file_id} is the input of batch {users[0]['id']}, which is {users[0]['status']}: "
                               "cancel the batch or wait for it to end", status=409, param="file_id")
        return self.store.delete_file(file_id)

    # ---- batches -------------------------------------------------------------------------
    async def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: dict | None = None, output_expires_after: dict | None = None) -> dict:
        self._check_owner()
        if endpoint not in ENDPOINTS:
            raise RequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if completion_window != "24h":
            raise RequestError(f"completion_window must be '24h', got {completion_window!r}",
                               param="completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise RequestError("metadata must be at most 16 string keys of up to 64 characters with string values of "
                               "up to 512", param="metadata")
        output_expires_after_s = expiry_seconds(output_expires_after, "output_expires_after")
        if self.store.file(input_file_id)["purpose"] != "batch":
            raise RequestError(f"file {input_file_id} was not uploaded with purpose 'batch'", param="input_file_id")
        batch = self.store.new_batch(input_file_id, endpoint, completion_window, metadata,
                                     self._or_default(output_expires_after_s))
        if await self._lines(batch) is not None:  # an invalid input fails now, not behind the queue
            self._queue.put_nowait(batch["id"])
        return self.store.batch(batch["id"])  # as it is now: a cancel may have come while the input was read

    def get_batch(self, batch_id: str) -> dict:
        return self.store.batch(batch_id)

    def list_batches(self, limit: int | None = None, after: str | None = None) -> dict:
        """A page of the batches (`limit`: at most 100, 20 by default), newest first, after the
        batch `after`."""
        return cursor_page(self.store.batches(), 20 if limit is None else limit, after, MAX_BATCHES_PAGE)

    def cancel_batch(self, batch_id: str) -> dict:
        """A queued batch is cancelled at once; the running one is cancelling until its executor's
        next step. Cancelling a cancelling batch again answers it as it is (a client's retry)."""
        self._check_owner()
        batch = self.store.batch(batch_id)
        if batch["status"] == "cancelling":
            return batch
        if batch["status"] not in WAITING:
            raise RequestError(f"batch {batch_id} is {batch['status']}; only a validating or in-progress batch "
                               "can be cancelled", status=409, param="batch_id")
        self._cancelled.add(batch_id)
        batch = self.store.update_batch(batch_id, status="cancelling", cancelling_at=self.store.now())
        if batch_id == self._running:
            return batch
        self._finish(batch_id, batch["request_counts"])  # its logs hold what a previous owner ran of it
        return self.store.batch(batch_id)

    def _or_default(self, expires_after_s: int | None) -> int | None:
        return self.file_expiry_s if expires_after_s is None else expires_after_s

    # ---- expiry --------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Expire the batches waiting past their window (the running one expires at its next
        step), then remove the expired files but the inputs of active batches."""
        for batch in self.store.batches():
            if batch["status"] in WAITING and batch["id"] != self._running and self._past_window(batch):
                await self._expire_waiting(batch)
        keep = {batch["input_file_id"] for batch in self.store.batches() if batch["status"] in ACTIVE}
        for file_id in self.store.sweep(keep):
            log.info("batch store %s: file %s expired and was removed", self.store.root, file_id)

    async def _sweep_every(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            if self._lock.held:
                try:
                    await self.sweep()
                except Exception:
                    log.exception("batch store %s: the sweep raised", self.store.root)

    def _past_window(self, batch: dict) -> bool:
        return self.store.now() >= batch["expires_at"]

    async def _expire_waiting(self, batch: dict) -> None:
        lines = await self._lines(batch)
        batch = self.store.batch(batch["id"])
        if lines is None or batch["status"] not in WAITING or batch["id"] == self._running:
            return  # failed for its input, or cancelled or taken up by its run while the input was read
        async with self._logs(batch["id"], lines) as (output, errors, counts, _):
            expired = self._expire_pending(batch, lines, output, errors, counts)
        self._finish(batch["id"], counts, expired)

    def _expire_pending(self, batch: dict, lines: list[BatchLine], output: ResultLog, errors: ResultLog,
                        counts: dict) -> bool:
        """Past the batch's window, give every line without a result a batch_expired error; whether
        any line has one (so a batch expired before a crash is expired again when resumed)."""
        if not self._past_window(batch):
            return False
        for line in lines:
            if line.custom_id not in output.done and line.custom_id not in errors.done:
                errors.append(expired_line(line.custom_id))
                counts["failed"] += 1
        return any((result.get("error") or {}).get("code") == "batch_expired" for result in errors.done.values())

    # ---- running -------------------------------------------------------------------------
    async def _run_all(self, owned: bool) -> None:
        if not owned:
            while not self._take_over():
                await asyncio.sleep(TAKE_OVER_EVERY_S)
            log.warning("batch store %s: its owner stopped, this server took it over", self.store.root)
        while True:
            batch_id = await self._queue.get()
            await self._run_or_fail(batch_id)

    async def _run_or_fail(self, batch_id: str) -> None:
        """One batch's fault (its executor or the disk raising) never stops the batches after it:
        the batch is resumed from its logs, and fails after RUNS_PER_BATCH faults."""
        for run in range(1, RUNS_PER_BATCH + 1):
            try:
                await self._run(batch_id)
                return
            except Exception as error:
                log.exception("batch %s: run %d of %d raised", batch_id, run, RUNS_PER_BATCH)
                fault = error
            if run < RUNS_PER_BATCH:
                await asyncio.sleep(RERUN_AFTER_S)
        try:
            self._fail(batch_id, fault)
        except Exception:
            log.exception("batch %s: could not be marked failed", batch_id)

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch["status"] not in ACTIVE:  # the sweep expired it while it waited
            return
        ending = self.store.ending(batch_id)
        if ending is not None:  # a crash while its logs were moving: end it as it was ending
            self._end(batch_id, ending)
            return
        if batch["status"] == "cancelling":
            self._cancelled.add(batch_id)
        self._running = batch_id  # from here a cancel leaves the batch cancelling for this run, and the sweep leaves it
        try:
            lines = await self._lines(batch)
            if lines is None:
                return
            batch = self.store.batch(batch_id)  # a cancel may have come while the input was read
            async with self._logs(batch_id, lines) as (output, errors, counts, usage):
                if batch["status"] == "validating":
                    self.store.update_batch(batch_id, status="in_progress", in_progress_at=self.store.now())

                saved_at = time.monotonic()

                def save() -> None:
                    nonlocal saved_at
                    self.store.update_batch(batch_id, request_counts=dict(counts), usage=usage.body())
                    saved_at = time.monotonic()

                def on_result(ok: bool) -> None:  # saving each result (a synced rename) capped a batch's rate
                    counts["completed" if ok else "failed"] += 1
                    if time.monotonic() - saved_at >= SAVE_EVERY_S:
                        save()

                def stop() -> bool:
                    return self._stopping or batch_id in self._cancelled or self._past_window(batch)

                if not stop():
                    run = asyncio.ensure_future(self.executor.run(lines, output, errors, self.options, stop,
                                                                  on_result))
                    try:
                        await asyncio.shield(run)
                    except asyncio.CancelledError:
                        await run  # stop() is waiting: the executor returns at its next step
                        raise
                    finally:
                        save()
                expired = batch_id not in self._cancelled and self._expire_pending(batch, lines, output, errors,
                                                                                   counts)
            self._finish(batch_id, counts, expired)
        finally:
            self._running = None

    async def _lines(self, batch: dict) -> list[BatchLine] | None:
        """The batch's input lines, read and parsed in a thread (50,000 lines take seconds, which the
        event loop, with the running batch's requests on it, does not wait), or None once it is failed
        for an invalid or missing input (one that ended while its input was read stays as it ended)."""
        try:
            path = self.store.content_path(batch["input_file_id"], expired_too=True)
            return await asyncio.to_thread(_parse_file, path, batch["endpoint"], self.max_lines)
        except (InputFileError, KeyError) as problem:
            message = getattr(problem, "message", None) or str(problem)  # NotFound: the input file is gone
            errors = getattr(problem, "errors", None) or [{"code": "invalid_file", "message": message,
                                                          "param": "input_file_id", "line": None}]
            if self.store.batch(batch["id"])["status"] in ACTIVE:
                self.store.update_batch(batch["id"], **self._adopt_logs(batch["id"]), status="failed",
                                        failed_at=self.store.now(), errors={"object": "list", "data": errors})
            self._cancelled.discard(batch["id"])
            return None

    @contextlib.asynccontextmanager
    async def _logs(self, batch_id: str, lines: list[BatchLine]
                    ) -> AsyncIterator[tuple[ResultLog, ResultLog, dict, BatchUsage]]:
        """The batch's result logs, its request counts and its usage as they stand (saved); the
        usage counts each line logged to the output. A resumed batch's logs are read back in a
        thread, as its input is."""
        output_path, errors_path = self.store.log_paths(batch_id)
        usage = BatchUsage()
        output = await asyncio.to_thread(ResultLog, output_path, usage.add)
        with output, await asyncio.to_thread(ResultLog, errors_path) as errors:
            counts = {"total": len(lines), "completed": len(output.done), "failed": len(errors.done)}
            self.store.update_batch(batch_id, request_counts=dict(counts), usage=usage.body())
            yield output, errors, counts, usage

    def _finish(self, batch_id: str, counts: dict, expired: bool = False) -> None:
        """End the batch: cancelled, expired or completed (finalizing first)."""
        now = self.store.now()
        if batch_id in self._cancelled:
            done = {"status": "cancelled", "cancelled_at": now}
        elif expired:
            done = {"status": "expired", "expired_at": now, "request_counts": counts}
        else:
            self.store.update_batch(batch_id, status="finalizing", finalizing_at=now, request_counts=counts)
            done = {"status": "completed", "completed_at": now}
        self._end(batch_id, done)

    def _end(self, batch_id: str, done: dict) -> None:
        """Turn the logs into the output and error files, then apply `done`. `done` is saved first
        and the files' ids follow from the batch's, so after a crash `_run` ends it the same way and
        finds what was already moved (a resumed run would open the moved logs anew, empty)."""
        self.store.set_ending(batch_id, done)
        self.store.update_batch(batch_id, **self._adopt_logs(batch_id), **done)
        self._cancelled.discard(batch_id)

    def _fail(self, batch_id: str, fault: Exception) -> None:
        error = {"code": "internal_error", "message": f"the batch's run raised {RUNS_PER_BATCH} times, last: "
                 f"{type(fault).__name__}: {fault}", "param": None, "line": None}
        self.store.update_batch(batch_id, **self._adopt_logs(batch_id), status="failed", failed_at=self.store.now(),
                                errors={"object": "list", "data": [error]})
        self._cancelled.discard(batch_id)

    def _adopt_logs(self, batch_id: str) -> dict:
        """The result logs as the batch's output and error files (None for an empty one)."""
        files = {}
        for key, path, kind in zip(("output_file_id", "error_file_id"), self.store.log_paths(batch_id),
                                   ("output", "error")):
            file = self.store.adopt_file(path, f"file-{batch_id.removeprefix('batch_')}-{kind}",
                                         f"{batch_id}_{kind}.jsonl", "batch_output",
                                         self.store.output_expires_after_s(batch_id))
            files[key] = file and file["id"]
        return files


def _parse_file(path: Path, endpoint: str, max_lines: int) -> list[BatchLine]:
    return parse_input(path.read_bytes(), endpoint, max_lines)
