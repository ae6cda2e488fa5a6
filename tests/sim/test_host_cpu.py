"""The host's CPU time from /proc: a hand-made /proc tree, and this machine's own with a spinning
process that carries a worker's title; a trace of the stack's CPU sampled while work runs."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.sim import host_cpu
from splitserve.sim.host_cpu import StackTrace


def process(proc: Path, pid: int, argv: list[str], name: str, utime: int, stime: int) -> None:
    folder = proc / str(pid)
    folder.mkdir()
    (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    (folder / "stat").write_text(f"{pid} ({name}) S 1 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 4 0\n")


def test_a_hand_made_proc_tree(tmp_path):
    tick = host_cpu.os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text("cpu  100 3 50 1000 20 0 5 2 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n")
    process(tmp_path, 12, ["ray::Worker.step", "--flag"], "ray::Worker (x)", 30, 10)  # a name with ") " in it
    process(tmp_path, 13, ["ray::ShardWorker"], "ray::ShardWorke", 5, 5)
    process(tmp_path, 14, ["ray::ProxyActor"], "ray::ProxyActor", 99, 1)  # the stack, not a worker
    process(tmp_path, 15, ["python", "ray::Worker"], "python", 99, 1)  # the title is the first word
    (tmp_path / "self").mkdir()
    # busy: user + nice + system + irq + softirq (guest is counted in user already; steal is no work of this host's)
    assert host_cpu.host_busy_s(tmp_path) == pytest.approx((100 + 3 + 50 + 0 + 5) / tick)
    processes = host_cpu.processes_cpu_s(tmp_path)
    assert processes[12] == ("ray::Worker.step", pytest.approx(40 / tick))
    assert processes[14] == ("ray::ProxyActor", pytest.approx(100 / tick))
    assert processes[15] == ("python", pytest.approx(100 / tick)) and set(processes) == {12, 13, 14, 15}
    with pytest.raises(OSError, match="/proc"):
        host_cpu.host_busy_s(tmp_path / "missing")

    def work():  # 60 ticks of host time, 25 of them a worker's: 35 the stack's
        (tmp_path / "stat").write_text("cpu  150 3 60 1000 20 0 5 9 7 0\n")  # 7 more ticks stolen: not work
        process(tmp_path, 16, ["ray::Worker"], "ray::Worker", 900, 0)  # started after the trace did: not read
        (tmp_path / "12" / "stat").write_text("12 (ray::Worker (x)) S 1 1 1 0 -1 0 0 0 0 0 50 15 0 0 20 0 4 0\n")
        return "done"

    result, trace = host_cpu.trace_while(work, interval_s=60.0, proc=tmp_path)  # no sample but the first and last
    assert result == "done" and trace.cpu_s == (0.0, pytest.approx(35 / tick))
    assert trace.between(trace.times_s[0], trace.times_s[1]) == pytest.approx(35 / tick)
    with pytest.raises(RuntimeError, match="a worker process ended while the host's CPU was sampled"):
        host_cpu.trace_while(lambda: (tmp_path / "13" / "stat").unlink(), interval_s=60.0, proc=tmp_path)


def test_a_trace_reads_any_window_off_its_samples():
    trace = StackTrace((10.0, 11.0, 13.0), (0.0, 0.5, 0.7))
    assert trace.between(10.0, 13.0) == pytest.approx(0.7)
    assert trace.between(10.5, 12.0) == pytest.approx(0.25 + 0.1)  # interpolated in each interval
    assert trace.between(9.0, 10.5) == pytest.approx(0.25)  # nothing sampled before the first
    assert trace.between(12.0, 20.0) == pytest.approx(0.1)  # nor after the last


def own_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / host_cpu.os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_process_titled_as_a_worker_is_counted_on_this_machine():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass"
    worker = subprocess.Popen(["bash", "-c", f"exec -a ray::Worker {sys.executable} -c '{spin}'"])
    try:
        time.sleep(0.2)  # exec'd and spinning
        start, host_start, own_start = host_cpu.processes_cpu_s(), host_cpu.host_busy_s(), own_cpu_s(worker.pid)
        time.sleep(0.5)
        own_end, host_end, end = own_cpu_s(worker.pid), host_cpu.host_busy_s(), host_cpu.processes_cpu_s()
    finally:
        worker.kill()
        worker.wait()
    own = own_end - own_start
    assert own >= 0.05  # it ran (on a core it may share)
    assert start[worker.pid][0] == "ray::Worker" and end[worker.pid][1] - start[worker.pid][1] >= own - 0.02
    assert host_end - host_start >= own - 0.02  # the host's busy time includes it (ticks of 10 ms)
    assert host_cpu.host_cores() >= 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_work_outside_the_workers_is_the_stacks():
    def spin() -> float:  # this process is no worker: its CPU is the stack's
        own = time.process_time()
        while time.process_time() - own < 0.3:
            pass
        return time.process_time() - own

    own, trace = host_cpu.trace_while(spin, interval_s=0.02)
    assert len(trace.times_s) >= 5  # sampled while it ran
    # the sampler's own reads and anything else the host ran outside the workers only add to it
    assert trace.between(trace.times_s[0], trace.times_s[-1]) >= own - 0.02  # ticks of 10 ms
