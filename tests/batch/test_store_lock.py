"""The batch store's lock: one holder per directory, given up by release and by the holder's death
(SIGKILL), as the kernel keeps flock; a waiting taker gets it once the holder exits."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from splitserve.batch.store_lock import StoreLock

HOLD = """
import sys, time
from pathlib import Path
from splitserve.batch.store_lock import StoreLock
assert StoreLock(Path(sys.argv[1])).try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_one_holder_per_directory_until_released(tmp_path):
    first, second = StoreLock(tmp_path), StoreLock(tmp_path)
    assert first.try_acquire() and first.held
    assert first.try_acquire()  # holding it already
    assert not second.try_acquire() and not second.held
    first.release()
    assert not first.held
    assert second.try_acquire()
    assert not first.try_acquire()
    second.release()


def test_a_killed_holder_gives_the_lock_up(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = StoreLock(tmp_path)
        assert not lock.try_acquire() and not lock.acquire_within(0.3, every_s=0.1)
        threading.Timer(0.5, holder.kill).start()
        started = time.monotonic()
        assert lock.acquire_within(30)  # waits while the holder exits
        assert 0.4 < time.monotonic() - started < 10
        lock.release()
    finally:
        holder.kill()
        holder.wait()
