"""Fault injection for failover drills and tests: make a worker die in the middle of a transfer."""
from __future__ import annotations

import os

from splitserve.transfer.transport import KVTransport


def crash_after_layer_pushes(transport: KVTransport, n: int) -> None:
    """The process exits right after the n-th layer push from now has left (a worker dying
    mid-prefill, with part of a request's KV sent)."""
    push, count = transport.push_layer, [0]

    def push_then_maybe_crash(*args):
        push(*args)
        count[0] += 1
        if count[0] == n:
            transport.flush()
            os._exit(1)

    transport.push_layer = push_then_maybe_crash
