"""Ray actors whose process leaves its start-up objects out of the garbage collector's full passes,
as Ray Serve does for a replica once it has started (`RAY_SERVE_FREEZE_GC_ON_STARTUP`). An actor's
imports (torch, Ray, pydantic, ...) are a quarter of a million objects or more that live as long as
the process; unfrozen, every full pass walks them all while it holds the GIL, and the actor's
loop, with every call waiting on it, stops meanwhile (`scripts/bench_actor_heaps.py`). An actor
that builds or reads large JSON (a stored response, a batch's lines) starts such passes often.

Frozen objects are still freed when their last reference goes; only a reference cycle among them
stays. So an actor whose start-up builds what it may later replace whole (a worker's engine) is
not frozen here."""
from __future__ import annotations

import gc
from typing import TypeVar

T = TypeVar("T")


def frozen_heap(cls: type[T]) -> type[T]:
    """`cls` for `ray.remote`: once an instance's `__init__` returns, its process's garbage is
    collected and the rest frozen."""
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        gc.collect()
        gc.freeze()

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__, "__doc__": cls.__doc__})
