"""An orphan lease expires once, `timeout_s` after its last renewal, and not while renewed."""
from __future__ import annotations

import threading
import time

from splitserve.cluster.orphan_lease import OrphanLease


def test_a_lease_nobody_renews_expires_once_after_its_timeout():
    expired = []
    started = time.monotonic()
    OrphanLease(0.2, lambda: expired.append(time.monotonic() - started), "w").start()
    time.sleep(0.5)
    assert len(expired) == 1 and 0.2 <= expired[0] < 0.4


def test_renewals_keep_a_lease_alive_and_it_expires_a_timeout_after_the_last():
    expired = threading.Event()
    lease = OrphanLease(0.3, expired.set, "w").start()
    for _ in range(6):  # 0.6 s of renewals, each well inside the timeout
        time.sleep(0.1)
        lease.renew()
        assert not expired.is_set()
    last = time.monotonic()
    assert lease.left_s() > 0.25
    assert expired.wait(1.0)
    assert time.monotonic() - last >= 0.3
