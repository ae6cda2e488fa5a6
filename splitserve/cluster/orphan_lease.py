"""How a detached actor (a worker, the rendezvous store) knows it was orphaned. They outlive the
CLS that started them, so that a new CLS adopts them with what they run; but an app deleted while
its CLS was dead leaves them with no CLS at all. The CLS renews each one's lease whenever it calls
it (every poll); one not renewed for `timeout_s` calls `expire` (it stops itself), once."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("splitserve.orphan")


class OrphanLease:
    def __init__(self, timeout_s: float, expire: Callable[[], None], what: str):
        self.timeout_s, self._expire, self.what = timeout_s, expire, what
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"orphan-lease-{what}")

    def start(self) -> "OrphanLease":
        self._thread.start()
        return self

    def renew(self) -> None:
        self._renewed = time.monotonic()

    def left_s(self) -> float:
        return self.timeout_s - (time.monotonic() - self._renewed)

    def _watch(self) -> None:
        while (left := self.left_s()) > 0:
            time.sleep(left)  # a renewal meanwhile moves the deadline: look again
        log.warning("%s: no CLS called for %.0f s (its app is gone); it stops", self.what, self.timeout_s)
        self._expire()
