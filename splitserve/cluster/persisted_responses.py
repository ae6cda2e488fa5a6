"""The response store on disk: each kept response is a file, `<dir>/<id>.json` (the Response, the
items it read, and a sequence number that orders the files by when each was kept), written whole
and renamed into place. So a restarted store (the actor restarted by Ray, the controller replica
replaced, the cluster restarted) has every response it kept, and an in-progress background one a
fresh lease for the replica that runs it to renew (or it ends failed). After a restart the least
recently kept go first (reads since were not written down). Not fsynced: a killed process loses
nothing, a machine that loses power may lose the last writes; a file that cannot be written (a full
disk) leaves its response kept in memory.

The directory is the head node's (`batch.dir`/responses, on Kubernetes the head pod's volume). One
server owns it at a time (a lock, as the batch store's; a new store waits a moment for the one it
replaces to exit): a store that finds it owned keeps its responses in memory, says so in its log,
and takes the directory over once it is given up (the old cluster of an upgrade deleted).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from splitserve.api.response_store import ResponseStore
from splitserve.batch.store_lock import StoreLock

log = logging.getLogger(__name__)
TAKE_OVER_WAIT_S = 10.0  # a replaced controller's store gives the directory up as its process exits


class PersistedResponseStore(ResponseStore):
    def __init__(self, max_responses: int, max_bytes: int, directory: str | Path | None,
                 clock: Callable[[], float] = time.monotonic):
        """`directory` None: in memory only."""
        super().__init__(max_responses, max_bytes, clock)
        self.directory: Path | None = None  # set once this store owns it (and has read it)
        self._sequence = 0  # the last file's
        self._root = None if directory is None else Path(directory).expanduser()
        if self._root is not None:
            self._root.mkdir(parents=True, exist_ok=True)
            self._lock = StoreLock(self._root)
            if not self._lock.acquire_within(TAKE_OVER_WAIT_S):
                log.warning("another server keeps its responses in %s: this one keeps them in memory until it can "
                            "take the directory over", self._root)
            self.take_over()

    def take_over(self) -> bool:
        """True once this store owns its directory, or has none. One that found it owned tries again
        here (the controller asks at each health check); once it holds it, the directory's responses
        are read, then those kept in memory meanwhile (newer) are kept on disk too."""
        if self._root is None or self.directory is not None:
            return True
        if not self._lock.try_acquire():
            return False
        meanwhile = [(response, items) for response, items, _ in self._entries.values()]
        self._entries.clear()
        self._leases.clear()
        self.bytes = self.event_bytes()  # streams recorded meanwhile stay, in memory
        self._read(self._root)
        self.directory = self._root
        for response, items in meanwhile:
            self.put(response, items)
        return True

    def _read(self, root: Path) -> None:
        read: dict[Path, dict] = {}
        for path in root.glob("*.json"):
            try:
                entry = json.loads(path.read_bytes())
                read[path] = {"sequence": int(entry["sequence"]), "response": dict(entry["response"]),
                              "items": list(entry["items"])}
            except (OSError, ValueError, KeyError, TypeError):
                log.exception("stored response %s does not read; left out (and left there)", path)
        for entry in sorted(read.values(), key=lambda entry: entry["sequence"]):
            self.put(entry["response"], entry["items"])
            self._sequence = entry["sequence"]
        for path, entry in read.items():
            if entry["response"].get("id") not in self._entries:  # past the bounds, which may have shrunk
                path.unlink(missing_ok=True)
        for path in root.glob(".*.tmp"):  # a write the process did not finish
            path.unlink(missing_ok=True)

    def _kept(self, response: dict, items: list[dict]) -> None:
        if self.directory is not None:
            path = self.directory / f"{response['id']}.json"
            temporary = path.with_name(f".{path.name}.tmp")
            self._sequence += 1
            try:
                temporary.write_text(json.dumps({"sequence": self._sequence, "response": response, "items": items}))
                os.replace(temporary, path)
            except OSError:  # a full disk: kept in memory still, and the request that kept it goes on
                log.exception("stored response %s could not be written to %s", response["id"], self.directory)

    def _dropped(self, response_id: str) -> None:
        if self.directory is not None:
            try:
                (self.directory / f"{response_id}.json").unlink(missing_ok=True)
            except OSError:
                log.exception("stored response %s could not be removed from %s", response_id, self.directory)
