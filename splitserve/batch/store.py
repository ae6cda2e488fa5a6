"""Files and batches of the batch API on disk, in the shapes OpenAI returns. Every metadata write
replaces its file atomically (write, fsync, rename), so a crash leaves the old or the new state.
A file past its `expires_at` is gone for readers at once; `sweep` removes it from disk.

Layout: files/<id> (content) and files/<id>.json (the file object); batches/<id>.json (the batch
object) with batches/<id>.output.jsonl and .errors.jsonl growing while it runs (`ResultLog`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

from splitserve.batch.usage import BatchUsage

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a restart resumes these
PURPOSES = ("batch", "batch_output")
WINDOW_S = 24 * 3600  # completion_window "24h": a batch not done by then expires
PRIVATE = "_"  # a batch's settings the API does not return start with it
ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # what an id may be (ours are file-<hex> and batch_<hex>)
log = logging.getLogger(__name__)


class NotFound(KeyError):
    def __init__(self, kind: str, object_id: str):
        super().__init__(object_id)
        self.message = f"No such {kind} object: {object_id}"


class BatchStore:
    def __init__(self, root: str | Path, clock: Callable[[], float] = time.time):
        self.root, self.clock = Path(root).expanduser(), clock
        for sub in ("files", "batches"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # batch objects are updated from the executor's thread too

    def now(self) -> int:
        return int(self.clock())

    # ---- files ---------------------------------------------------------------------------
    def add_file(self, content: bytes, filename: str, purpose: str, expires_after_s: int | None = None) -> dict:
        """A new file, expiring `expires_after_s` after its creation (None: kept until deleted)."""
        file_id = _new_id("file-")
        path = self.root / "files" / file_id
        _write_atomic(path, content)
        return self._describe_file(file_id, path, filename, purpose, expires_after_s)

    def adopt_file(self, path: Path, file_id: str, filename: str, purpose: str,
                   expires_after_s: int | None = None) -> dict | None:
        """Move a finished log into the files as `file_id` (None when it is empty or absent).
        Idempotent: a second call after a crash finds the file already moved."""
        target = self.root / "files" / file_id
        if path.exists():
            if not path.stat().st_size:
                path.unlink()
                return None
            os.replace(path, target)
        if not target.exists():
            return None
        meta = target.with_name(file_id + ".json")
        if meta.exists():
            return json.loads(meta.read_bytes())
        return self._describe_file(file_id, target, filename, purpose, expires_after_s)

    def _describe_file(self, file_id: str, path: Path, filename: str, purpose: str,
                       expires_after_s: int | None) -> dict:
        now = self.now()
        meta = {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": now,
                "expires_at": None if expires_after_s is None else now + expires_after_s, "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}
        _write_atomic(path.with_name(file_id + ".json"), json.dumps(meta).encode())
        return meta

    def file(self, file_id: str) -> dict:
        meta = self._read("files", file_id, "File")
        if self._expired(meta):
            raise NotFound("file", file_id)
        return meta

    def files(self, purpose: str | None = None) -> list[dict]:
        found = self._read_all("files", "file-*.json")
        return sorted((f for f in found if purpose in (None, f["purpose"]) and not self._expired(f)),
                      key=_newest_first, reverse=True)

    def content_path(self, file_id: str, expired_too: bool = False) -> Path:
        """Where a file's content is; `expired_too`: also one expired but not yet swept (a running
        batch's input, which `sweep` keeps)."""
        if expired_too:
            self._read("files", file_id, "File")
        else:
            self.file(file_id)
        return self.root / "files" / file_id

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        (self.root / "files" / f"{file_id}.json").unlink()
        (self.root / "files" / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def sweep(self, keep: Collection[str] = ()) -> list[str]:
        """Remove the expired files but those in `keep`; their ids."""
        gone = []
        for meta in self._read_all("files", "file-*.json"):
            if self._expired(meta) and meta["id"] not in keep:
                path = self.root / "files" / meta["id"]
                path.with_name(meta["id"] + ".json").unlink()
                path.unlink(missing_ok=True)
                gone.append(meta["id"])
        return gone

    def _expired(self, meta: dict) -> bool:
        return meta.get("expires_at") is not None and meta["expires_at"] <= self.now()

    # ---- batches -------------------------------------------------------------------------
    def new_batch(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None,
                  output_expires_after_s: int | None = None) -> dict:
        """A validating batch; its output and error files will expire `output_expires_after_s`
        after they are written (None: kept until deleted)."""
        now = self.now()
        batch = {"id": _new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "usage": BatchUsage().body(),
                 "metadata": metadata,
                 PRIVATE + "output_expires_after_s": output_expires_after_s}
        with self._lock:
            _write_atomic(self.root / "batches" / f"{batch['id']}.json", json.dumps(batch).encode())
        return _public(batch)

    def update_batch(self, batch_id: str, **changes) -> dict:
        with self._lock:
            batch = {**self._read("batches", batch_id, "Batch"), **changes}
            _write_atomic(self.root / "batches" / f"{batch_id}.json", json.dumps(batch).encode())
        return _public(batch)

    def batch(self, batch_id: str) -> dict:
        return _public(self._read("batches", batch_id, "Batch"))

    def output_expires_after_s(self, batch_id: str) -> int | None:
        return self._read("batches", batch_id, "Batch").get(PRIVATE + "output_expires_after_s")

    def ending(self, batch_id: str) -> dict | None:
        """The end an active batch was given before its logs moved (`set_ending`); a finalizing one
        without (a store a version before wrote) is completing: its results are all logged."""
        batch = self._read("batches", batch_id, "Batch")
        if batch["status"] not in ACTIVE:
            return None
        completing = {"status": "completed", "completed_at": self.now()} if batch["status"] == "finalizing" else None
        return batch.get(PRIVATE + "ending") or completing

    def set_ending(self, batch_id: str, done: dict) -> None:
        self.update_batch(batch_id, **{PRIVATE + "ending": done})

    def batches(self) -> list[dict]:
        found = [_public(meta) for meta in self._read_all("batches", "batch_*.json")]
        return sorted(found, key=_newest_first, reverse=True)

    def log_paths(self, batch_id: str) -> tuple[Path, Path]:
        base = self.root / "batches" / batch_id
        return base.with_name(batch_id + ".output.jsonl"), base.with_name(batch_id + ".errors.jsonl")

    def _read(self, sub: str, object_id: str, kind: str) -> dict:
        path = self.root / sub / f"{object_id}.json"
        if not ID.fullmatch(object_id) or not path.is_file():
            raise NotFound(kind.lower(), object_id)
        return json.loads(path.read_bytes())

    def _read_all(self, sub: str, pattern: str) -> list[dict]:
        """Every object in `sub`; one that cannot be read (a store copied or edited by hand) is
        logged and left out, not a failure of every list."""
        found = []
        for path in (self.root / sub).glob(pattern):
            try:
                found.append(json.loads(path.read_bytes()))
            except (OSError, ValueError) as error:
                log.error("batch store %s: %s is unreadable, left out: %s", self.root, path.name, error)
        return found


def _new_id(prefix: str) -> str:
    """32 hex digits, the first 16 the creation time in ns: ids made in one second sort in creation order."""
    return f"{prefix}{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def _newest_first(meta: dict) -> tuple[int, str]:
    """The key, reversed, that lists objects newest first (and a restart resumes batches oldest first)."""
    return meta["created_at"], meta["id"]


def _public(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if not key.startswith(PRIVATE)}


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
