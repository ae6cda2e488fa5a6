"""Python's cyclic garbage collector held off around work that makes many objects and no cycles."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No collection starts inside; the collector is left as it was (on, or already off). Work
    that makes many objects and no cycles gives it nothing to find, while each of its full passes
    would walk every object made so far."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
