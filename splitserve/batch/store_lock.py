"""One server at a time runs a batch store's batches: an exclusive advisory lock (flock) on
`<dir>/.lock`, held while the process serves the store. Two servers on one directory (two
clusters left on the default `batch.dir`, or the old and the new cluster of a zero-downtime
upgrade on a shared volume) would otherwise both resume its active batches and append to the same
result logs. The kernel drops the lock when its holder exits or is killed; over NFS the server
drops it when the client's lease ends."""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class StoreLock:
    def __init__(self, root: Path):
        self.path = root / ".lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no other holder has it (never waits); True while this one holds it."""
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._fd = fd
        return True

    def acquire_within(self, timeout_s: float, every_s: float = 0.2) -> bool:
        """Take the lock, trying every `every_s` for up to `timeout_s` (a holder that is exiting,
        say the process of a store being replaced, gives it up in a moment)."""
        deadline = time.monotonic() + timeout_s
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                return False
            time.sleep(every_s)
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
