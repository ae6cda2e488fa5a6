"""CPU time spent on this (Linux) host, read from /proc: by every process together, and by the
cluster's worker processes (Ray actors whose process title starts `ray::Worker` or
`ray::ShardWorker`; Ray titles an actor's process with its class). What is left is the serving
stack around the workers: Serve's proxy, the ingress, the CLS, Ray's own daemons and the clients.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

WORKER_TITLES = ("ray::Worker", "ray::ShardWorker")
PROC = Path("/proc")
T = TypeVar("T")


@dataclass(frozen=True)
class CpuSample:
    at_s: float       # time.perf_counter() when taken
    host_s: float     # CPU seconds every core has spent busy (neither idle nor waiting on I/O) since boot
    workers_s: float  # CPU seconds the worker processes now alive have spent since they started


def sample(proc: Path = PROC) -> CpuSample:
    at_s, host_s = time.perf_counter(), host_busy_s(proc)  # first: it names a missing /proc
    workers = sum(cpu_s for title, cpu_s in processes_cpu_s(proc).values() if title.startswith(WORKER_TITLES))
    return CpuSample(at_s, host_s, workers)


def host_busy_s(proc: Path = PROC) -> float:
    """CPU seconds every core has spent busy (neither idle nor waiting on I/O) since boot."""
    if not (proc / "stat").exists():
        raise OSError(f"{proc / 'stat'} is not readable: measuring the host's CPU needs Linux's /proc")
    fields = [int(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal, less idle and iowait (guest time is in user)
    return busy / os.sysconf("SC_CLK_TCK")


def processes_cpu_s(proc: Path = PROC) -> dict[int, tuple[str, float]]:
    """Every live process by pid: its title (its command line's first word) and the CPU seconds
    it has spent since it started (every thread's)."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
            found[int(entry.name)] = (title, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return found


def stack_cpu_while(work: Callable[[], T], idle_s: float) -> tuple[T, float]:
    """`work()`'s result, and the CPU seconds the host spent outside the workers while it ran, less
    what it spends so while idle: the lower of two reads over `idle_s` seconds, just before and
    just after. Other work caught in a read (a previous job winding down, a burst of Ray's own
    bookkeeping) only raises it, and one read stretched over the whole run would take it off the
    stack's time many times over."""
    before = idle_cores(idle_s)
    start = sample()
    result = work()
    end = sample()
    return result, stack_cpu_s(start, end, min(before, idle_cores(idle_s)))


def idle_cores(seconds: float) -> float:
    """The cores' worth of CPU the host spends outside the workers over the next `seconds`."""
    start = sample()
    time.sleep(seconds)
    end = sample()
    return stack_cpu_s(start, end) / (end.at_s - start.at_s)


def stack_cpu_s(start: CpuSample, end: CpuSample, background_cores: float = 0.0) -> float:
    """CPU seconds the host spent outside the workers between two samples, less `background_cores`
    (what it spends so while nothing is served) over that time."""
    return (end.host_s - start.host_s) - (end.workers_s - start.workers_s) - background_cores * (end.at_s - start.at_s)


def host_cores() -> int:
    """The cores this process may run on (the host's, unless it is confined)."""
    return len(os.sched_getaffinity(0))
