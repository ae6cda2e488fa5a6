"""The response store on disk: each kept response is a file of `JsonFiles` (the Response and the
items it read), so a restarted store (the actor restarted by Ray, the controller replica replaced,
the cluster restarted) has every response it kept, and an in-progress background one a fresh lease
for the replica that runs it to renew (or it ends failed). After a restart the least recently kept
go first (reads since were not written down). A file that cannot be written (a full disk) leaves
its response kept in memory. The conversations the same actor keeps are files too, in
`<dir>/conversations` (`persisted_conversations`).

The directory is the head node's (`batch.dir`/responses, on Kubernetes the head pod's volume). One
server owns it at a time (a lock, as the batch store's; a new store waits a moment for the one it
replaces to exit): a store that finds it owned keeps its responses in memory, says so in its log,
and takes the directory over once it is given up (the old cluster of an upgrade deleted).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from splitserve.api.response_store import ResponseStore, Stored
from splitserve.batch.store_lock import StoreLock
from splitserve.cluster.json_files import JsonFiles
from splitserve.cluster.persisted_conversations import PersistedConversations

log = logging.getLogger(__name__)
TAKE_OVER_WAIT_S = 10.0  # a replaced controller's store gives the directory up as its process exits


class PersistedResponseStore(ResponseStore):
    def __init__(self, max_responses: int, max_bytes: int, directory: str | Path | None,
                 clock: Callable[[], float] = time.monotonic, max_conversations: int = 0,
                 max_conversation_bytes: int = 0):
        """`directory` None: in memory only."""
        super().__init__(max_responses, max_bytes, clock, PersistedConversations(max_conversations,
                                                                                 max_conversation_bytes))
        self.directory: Path | None = None  # set once this store owns it (and has read it)
        self._files: JsonFiles | None = None
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
        files = JsonFiles(self._root)
        read = []
        for name, lines in files.read_fields():
            try:
                [entry] = lines
                (response, response_text), (items, items_text) = entry["response"], entry["items"]
                if not isinstance(items, list):
                    raise TypeError(f"a response's items are a list, not {type(items).__name__}")
                self.put(Stored.of(response, response_text), items_text)
            except (KeyError, TypeError, ValueError):
                log.exception("stored response %s does not read; left out (and left there)", name)
                continue
            read.append(name)
        for name in read:
            if name not in self._entries:  # past the bounds, which may have shrunk
                files.remove(name)
        self.directory, self._files = self._root, files
        for response, items in meanwhile:
            self.put(response, items)
        self.conversations.attach(JsonFiles(self._root / "conversations", ".jsonl"))
        return True

    def _kept(self, response: Stored, items: str) -> None:
        if self._files is not None:
            self._files.write_encoded(response.id, {"response": response.text, "items": items})

    def _dropped(self, response_id: str) -> None:
        if self._files is not None:
            self._files.remove(response_id)
