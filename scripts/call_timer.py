"""Wall time spent inside one function, for benchmarks that time a part of a larger call."""
from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable, record: Callable[[float], None]) -> Callable:
    """`fn`, handing the seconds each call took to `record` (a call that raises too)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)
    return wrapper
