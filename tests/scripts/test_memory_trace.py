"""The soak's memory tracing: the setup hook travels to a process that cannot import it (as Ray
ships it to its workers) and writes the heap's state there, with tracemalloc snapshots when tracing;
comparing two snapshots names the line that allocated what is still held."""
import inspect
import json
import subprocess
import sys
import tracemalloc

import pytest

from tests.scripts.script_runner import load_script

memory_trace = load_script("memory_trace")


@pytest.mark.parametrize("frames", [6, 0])
def test_the_hook_runs_where_its_file_cannot_be_imported_and_writes_heap_states_and_snapshots(tmp_path, frames,
                                                                                              monkeypatch):
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    monkeypatch.setitem(sys.modules, "memory_trace", memory_trace)  # imported, and shipped, as the soak does
    cloudpickle.register_pickle_by_value(memory_trace)
    try:
        hook = cloudpickle.dumps(memory_trace.setup_hook(str(tmp_path), every_s=0.05, frames=frames))  # raised to 1 s
    finally:
        cloudpickle.unregister_pickle_by_value(memory_trace)
    code = ("import os, sys, time, pickle; pickle.loads(sys.stdin.buffer.read())(); "
            f"import tracemalloc; assert tracemalloc.is_tracing() == {bool(frames)}; deadline = time.time() + 30\n"
            "while sum(name.endswith('.json') for name in os.listdir('.')) < 3 and time.time() < deadline:\n"
            "    time.sleep(0.05)")
    done = subprocess.run([sys.executable, "-c", code], input=hook, capture_output=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    (pid,) = {int(path.name.split("-")[0]) for path in tmp_path.iterdir()}
    taken = memory_trace.snapshots(str(tmp_path), pid)
    assert len(taken) >= 2
    heap = json.loads(taken[-1][1].read_text())
    assert heap["rss"] > heap["malloc_in_use"] > 0 and heap["malloc_free"] >= 0, heap
    assert (heap["traced"] > 0) == bool(frames), heap
    snaps = [path.with_suffix(".snap") for _, path in taken]
    if frames:
        assert all(isinstance(tracemalloc.Snapshot.load(str(path)), tracemalloc.Snapshot) for path in snaps)
    else:
        assert not any(path.exists() for path in snaps)


def test_growth_from_the_first_state_since_a_time_to_the_last_names_the_allocating_line(tmp_path):
    def dump(stem: str, rss: float) -> None:
        tracemalloc.take_snapshot().dump(str(tmp_path / f"{stem}.snap"))
        heap = {"rss": rss, "malloc_in_use": rss / 2, "malloc_free": 1.0, "traced": 0.0}
        (tmp_path / f"{stem}.json").write_text(json.dumps(heap))

    tracemalloc.start(4)
    try:
        dump("7-100", 10.0)  # before `since`: ignored
        dump("7-200", 20.0)
        held, line = [bytearray(1024) for _ in range(2048)], inspect.currentframe().f_lineno  # 2 MB, still held
        dump("7-320", 26.0)
        tracemalloc.take_snapshot().dump(str(tmp_path / "7-330.snap"))  # its state not written yet
    finally:
        tracemalloc.stop()
    growth = memory_trace.memory_growth(str(tmp_path), 7, since=150)
    assert growth["minutes"] == 2.0
    assert (growth["rss_mb"], growth["malloc_in_use_mb"], growth["malloc_free_mb"]) == (6.0, 3.0, 0.0)
    assert 2.0 <= growth["traced_mb"] < 2.5, growth
    top = growth["top"][0]
    assert top["blocks"] >= 2048 and top["kb"] >= 2048
    assert top["at"][-1].endswith(f"test_memory_trace.py:{line}"), top
    assert memory_trace.memory_growth(str(tmp_path), 7, since=250) is None  # one state left
    del held


def test_without_tracing_the_growth_is_the_heaps_alone(tmp_path):
    for stem, rss in (("9-10", 100.0), ("9-70", 104.0)):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"rss": rss, "malloc_in_use": 50.0, "malloc_free": rss - 90,
                                                           "traced": 0.0}))
    assert memory_trace.memory_growth(str(tmp_path), 9, since=0) == {
        "minutes": 1.0, "rss_mb": 4.0, "malloc_in_use_mb": 0.0, "malloc_free_mb": 4.0}
