"""The host's CPU time from /proc: a hand-made /proc tree, and this machine's own with a spinning
process that carries a worker's title."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.sim import host_cpu
from splitserve.sim.host_cpu import CpuSample


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
    cpu = host_cpu.sample(tmp_path)
    # busy: user + nice + system + irq + softirq + steal (guest is counted in user already)
    assert cpu.host_s == pytest.approx((100 + 3 + 50 + 0 + 5 + 2) / tick)
    assert cpu.workers_s == pytest.approx((30 + 10 + 5 + 5) / tick)
    processes = host_cpu.processes_cpu_s(tmp_path)
    assert processes[14] == ("ray::ProxyActor", pytest.approx(100 / tick))
    assert processes[15] == ("python", pytest.approx(100 / tick)) and set(processes) == {12, 13, 14, 15}
    with pytest.raises(OSError, match="/proc"):
        host_cpu.sample(tmp_path / "missing")


def test_the_stack_is_what_the_workers_did_not_spend_less_the_background():
    start, end = CpuSample(0.0, 100.0, 40.0), CpuSample(10.0, 112.0, 47.0)
    assert host_cpu.stack_cpu_s(start, end) == pytest.approx(5.0)
    assert host_cpu.stack_cpu_s(start, end, background_cores=0.2) == pytest.approx(3.0)


def own_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / host_cpu.os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_process_titled_as_a_worker_is_counted_on_this_machine():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass"
    worker = subprocess.Popen(["bash", "-c", f"exec -a ray::Worker {sys.executable} -c '{spin}'"])
    try:
        time.sleep(0.2)  # exec'd and spinning
        start, own_start = host_cpu.sample(), own_cpu_s(worker.pid)
        time.sleep(0.5)
        own_end, end = own_cpu_s(worker.pid), host_cpu.sample()
    finally:
        worker.kill()
        worker.wait()
    own = own_end - own_start
    assert own >= 0.05  # it ran (on a core it may share)
    # the workers' time holds its own (and any real worker's alive on this machine, such as a test cluster's)
    assert end.workers_s - start.workers_s >= own - 0.02  # ticks of 10 ms
    assert end.host_s - start.host_s >= own - 0.02  # the host's busy time includes it
    assert host_cpu.host_cores() >= 1


@pytest.mark.parametrize("after_outside_s, background", [(0.3, 0.15), (0.9, 0.25)],
                         ids=["quieter-after", "quieter-before"])
def test_the_lower_idle_rate_is_taken_off(monkeypatch, after_outside_s, background):
    samples = iter([CpuSample(0.0, 10.0, 4.0), CpuSample(2.0, 11.0, 4.5),  # idle before: 0.5 s outside in 2 s
                    CpuSample(2.0, 11.0, 4.5), CpuSample(7.0, 20.0, 8.0),  # the work: 9 s busy, 3.5 s of it the workers'
                    CpuSample(7.0, 20.0, 8.0), CpuSample(9.0, 20.0 + after_outside_s, 8.0)])  # idle after
    monkeypatch.setattr(host_cpu, "sample", lambda: next(samples))
    monkeypatch.setattr(host_cpu.time, "sleep", lambda s: None)
    result, stack = host_cpu.stack_cpu_while(lambda: "done", idle_s=2.0)
    assert result == "done" and stack == pytest.approx(5.5 - background * 5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_work_outside_the_workers_is_the_stacks():
    start, own = host_cpu.sample(), time.process_time()  # this process is no worker: its CPU is the stack's
    while time.process_time() - own < 0.3:
        pass
    own, end = time.process_time() - own, host_cpu.sample()
    # anything else the host ran outside the workers meanwhile only adds to it
    assert host_cpu.stack_cpu_s(start, end) >= own - 0.02  # ticks of 10 ms
