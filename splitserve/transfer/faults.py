"""Fault injection for failover drills and tests: make a worker die, or freeze, in the middle of a
transfer. Reachable on a cluster worker only when its config enables fault injection."""
from __future__ import annotations

import os
import signal

from splitserve.transfer.transport import KVTransport


def crash_after_layer_pushes(transport: KVTransport, n: int) -> None:
    """The process exits right after the n-th layer push from now has left (a worker dying
    mid-prefill, with part of a request's KV sent)."""
    _after_layer_pushes(transport, n, lambda: os._exit(1))


def freeze_after_layer_pushes(transport: KVTransport, n: int) -> None:
    """The process stops itself (SIGSTOP) right after the n-th layer push from now has left: a
    worker stalled mid-transfer, alive but silent, until someone sends it SIGCONT."""
    _after_layer_pushes(transport, n, lambda: os.kill(os.getpid(), signal.SIGSTOP))


def watch_layer_pushes(transport: KVTransport, after_push) -> None:
    """`after_push()` runs after each layer push (a layer's KV or a piece of it): `push_layer` (a
    payload) or a layer's `write_kv` (into a same-node peer's cache)."""
    def watched(method, is_layer):
        def push(*args):
            result = method(*args)
            if is_layer(*args):
                after_push()
            return result
        return push

    transport.push_layer = watched(transport.push_layer, lambda *args: True)
    transport.write_kv = watched(transport.write_kv, lambda ticket, kind, *rest: kind >= 0)


def _after_layer_pushes(transport: KVTransport, n: int, then) -> None:
    count = [0]

    def counted() -> None:
        count[0] += 1
        if count[0] == n:
            transport.flush()
            then()

    watch_layer_pushes(transport, counted)
