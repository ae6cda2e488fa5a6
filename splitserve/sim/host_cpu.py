"""CPU time spent on this (Linux) host, read from /proc: by every process together, and by the
cluster's worker processes (Ray actors whose process title starts `ray::Worker` or
`ray::ShardWorker`; Ray titles an actor's process with its class). What is left is the serving
stack around the workers: Serve's proxy, the ingress, the CLS, Ray's own daemons and the clients;
`trace_while` samples it while requests run, so that any window of them can be read off.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

WORKER_TITLES = ("ray::Worker", "ray::ShardWorker")
PROC = Path("/proc")
T = TypeVar("T")


def host_busy_s(proc: Path = PROC) -> float:
    """CPU seconds every core has spent running since boot: not idle, waiting on I/O, nor stolen
    (a virtual machine's core the hypervisor gave another guest ran none of this host's work)."""
    if not (proc / "stat").exists():
        raise OSError(f"{proc / 'stat'} is not readable: measuring the host's CPU needs Linux's /proc")
    fields = [int(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields[:7]) - fields[3] - fields[4]  # user..softirq, less idle and iowait (guest time is in user)
    return busy / os.sysconf("SC_CLK_TCK")


def processes_cpu_s(proc: Path = PROC) -> dict[int, tuple[str, float]]:
    """Every live process by pid: its title (its command line's first word) and the CPU seconds
    it has spent since it started (every thread's)."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            found[int(entry.name)] = (title, _cpu_s(entry / "stat"))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return found


def host_cores() -> int:
    """The cores this process may run on (the host's, unless it is confined)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class StackTrace:
    """The CPU seconds the host spent outside the workers, sampled while some work ran: at each of
    `times_s` (time.perf_counter()), the total since the first sample."""
    times_s: tuple[float, ...]
    cpu_s: tuple[float, ...]

    def between(self, start_s: float, end_s: float) -> float:
        """CPU seconds spent outside the workers from `start_s` to `end_s`, the totals interpolated
        linearly between samples (and held at the first and the last outside them)."""
        return self._at(end_s) - self._at(start_s)

    def _at(self, t: float) -> float:
        i = bisect.bisect_right(self.times_s, t)
        if i == 0 or i == len(self.times_s):
            return self.cpu_s[min(i, len(self.cpu_s) - 1)]
        t0, t1, c0, c1 = self.times_s[i - 1], self.times_s[i], self.cpu_s[i - 1], self.cpu_s[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def trace_while(work: Callable[[], T], interval_s: float, proc: Path = PROC) -> tuple[T, StackTrace]:
    """`work()`'s result, and the host's CPU outside the workers sampled every `interval_s` while it
    ran (on a thread of this process). The workers are the processes titled as workers when it
    starts; reading only theirs keeps a sample cheap (a few files), so short intervals cost the
    stack little. One of them ending mid-run is an error: its CPU would leave the workers' total."""
    workers = [proc / str(pid) / "stat" for pid, (title, _) in processes_cpu_s(proc).items()
               if title.startswith(WORKER_TITLES)]
    times, cpu, failed, stop = [], [], [], threading.Event()

    def take() -> None:
        try:
            workers_s = sum(_cpu_s(stat) for stat in workers)
        except OSError:
            raise RuntimeError("a worker process ended while the host's CPU was sampled") from None
        times.append(time.perf_counter())
        cpu.append(host_busy_s(proc) - workers_s)

    def sample_until_stopped() -> None:
        try:
            while not stop.wait(interval_s):
                take()
        except Exception as exc:  # raised where the work ran, once it has
            failed.append(exc)

    take()
    thread = threading.Thread(target=sample_until_stopped, name="stack-cpu", daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]
    take()
    return result, StackTrace(tuple(times), tuple(c - cpu[0] for c in cpu))


def _cpu_s(stat: Path) -> float:
    """The CPU seconds (user and system, every thread's) of the process whose /proc stat file this is."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
