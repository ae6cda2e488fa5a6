"""Where a long-running process's memory grows: every Ray worker process writes its heap's state
at a fixed interval, and where asked traces its Python allocations (tracemalloc), a snapshot
beside each state; afterwards two of a process's snapshots are compared by the call site that
allocated what is still held.

tracemalloc sees only Python's allocations; glibc's heap counts (`mallinfo2`) add what C and C++
code (Ray's core, torch) holds through malloc, and what malloc keeps free but has not returned to
the system. Resident growth that neither shows is in other mappings (a C++ allocator's own, an
mmap'd buffer)."""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path


def heap_state() -> dict:
    """This process's resident memory and glibc's heap, all arenas (bytes): in use (in arenas, and
    mmap'd chunks), and freed but kept in arenas. It runs in Ray workers, which cannot import this
    file: a script that ships it registers this module with Ray's cloudpickle to travel by value."""
    import ctypes  # here: a ctypes structure cannot be pickled, so it is built where it runs
    import os

    class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2, every field a size_t
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    heap = mallinfo2()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "malloc_in_use": heap.uordblks + heap.hblkhd, "malloc_free": heap.fordblks}


def setup_hook(directory: str, every_s: float, frames: int = 6):
    """A `worker_process_setup_hook` for `ray.init(runtime_env=...)`: every `every_s`, the process
    writes its heap's state (MB) into `directory` as `<pid>-<unix seconds>.json`; with `frames`, it
    also traces that many frames per allocation, its snapshot beside the state as `.snap` (tracing
    slows a process severalfold; without it, the heap's counts cost nothing). Names are whole
    seconds, so the interval is at least one: no state overwrites another."""
    every_s = max(every_s, 1.0)

    def hook() -> None:  # nested, so Ray pickles it by value with its settings
        import json
        import os
        import threading
        import time
        import tracemalloc

        if frames:
            tracemalloc.start(frames)

        def dump_forever() -> None:
            while True:
                time.sleep(every_s)
                stem = f"{directory}/{os.getpid()}-{int(time.time())}"
                if frames:
                    tracemalloc.take_snapshot().dump(f"{stem}.snap")
                state = {**heap_state(), "traced": tracemalloc.get_traced_memory()[0]}
                with open(f"{stem}.tmp", "w") as out:  # then renamed: a state on disk is whole
                    json.dump({key: round(value / 2**20, 2) for key, value in state.items()}, out)
                os.replace(f"{stem}.tmp", f"{stem}.json")

        threading.Thread(target=dump_forever, name="memory-trace", daemon=True).start()
    return hook


def snapshots(directory: str, pid: int) -> list[tuple[int, Path]]:
    """`pid`'s heap states in `directory` as (unix seconds, path), oldest first (a snapshot, where
    there is one, is written before its state)."""
    return sorted((int(path.stem.split("-")[1]), path) for path in Path(directory).glob(f"{pid}-*.json"))


def memory_growth(directory: str, pid: int, since: float, top: int = 8) -> dict | None:
    """How `pid`'s resident memory and heap grew from its first state at or after unix time `since`
    to its last; where traced, the Python memory it gained and the call sites that gained most (each
    by its traceback, outermost frame first). None with fewer than two states."""
    taken = [(at, path) for at, path in snapshots(directory, pid) if at >= since]
    if len(taken) < 2:
        return None
    (first_at, first), (last_at, last) = taken[0], taken[-1]
    before, after = json.loads(first.read_text()), json.loads(last.read_text())
    growth = {"minutes": round((last_at - first_at) / 60, 1),
              **{f"{key}_mb": round(after[key] - before[key], 2) for key in ("rss", "malloc_in_use", "malloc_free")}}
    if not first.with_suffix(".snap").exists():
        return growth
    old, new = (tracemalloc.Snapshot.load(str(path.with_suffix(".snap"))) for path in (first, last))
    diffs = sorted(new.compare_to(old, "traceback"), key=lambda stat: stat.size_diff, reverse=True)
    return {**growth, "traced_mb": round(sum(stat.size_diff for stat in diffs) / 2**20, 2),
            "traced_end_mb": round(sum(stat.size for stat in diffs) / 2**20, 1),
            "top": [{"kb": round(stat.size_diff / 1024, 1), "blocks": stat.count_diff,
                     "at": [f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}"
                            for frame in stat.traceback]}
                    for stat in diffs[:top]]}
