"""The idle-CPU benchmark: its accounting by process title on hand-made readings, and a tiny run
end to end (its own local Ray, in a subprocess) that reports every part for each interval."""
import pytest

from tests.scripts.script_runner import load_script, run_ray_script, run_script

bench_idle = load_script("bench_idle")


def test_processes_are_counted_in_their_part_over_the_window():
    before = {1: ("ray::Worker.report", 10.0), 2: ("ray::Controller", 4.0), 3: ("ray::ProxyActor", 1.0),
              4: ("ray::BatchManager", 2.0), 5: ("/usr/bin/raylet", 7.0), 6: ("ray::ServeReplica:main:Ingress", 3.0)}
    after = {1: ("ray::Worker.report", 12.0), 2: ("ray::Controller", 5.0), 3: ("ray::ProxyActor", 1.5),
             4: ("ray::BatchManager", 2.5), 5: ("/usr/bin/raylet", 8.0), 6: ("ray::ServeReplica:main:Ingress", 3.5),
             7: ("ray::Worker", 100.0)}  # started inside the window: its time is not the window's alone
    cores = bench_idle.cores_by_part(before, after, seconds=10.0)
    assert cores == pytest.approx({"workers": 0.2, "cls": 0.1, "serve": 0.1, "other actors": 0.05, "rest": 0.1})


def test_the_summary_is_the_median_per_interval():
    rows = [{"idle_report_interval_s": i, "repeat": r, "host_cores": h, **dict.fromkeys(bench_idle.PARTS, h / 5),
             "rest": 0.0} for r, (i, h) in enumerate([(0.1, 0.3), (1.0, 0.2), (0.1, 0.5), (1.0, 0.1), (0.1, 0.4)])]
    summary = bench_idle.summarize(rows)
    assert [(s["idle_report_interval_s"], s["runs"], s["host_cores"]) for s in summary] == \
        [(0.1, 3, pytest.approx(0.4)), (1.0, 2, pytest.approx(0.15))]


@pytest.mark.quiet
def test_tiny_run_reports_every_part(tmp_path):
    # a 3 s window: the CLS's CPU time is counted in 10 ms ticks, and in 1 s an idle one sometimes used none
    done, result = run_ray_script("bench_idle", tmp_path, "--idle-intervals", "0.5", "--settle", "0", "--window", "3",
                                  "--repeats", "1", "--port", "8026", timeout=400)
    (row,), (summary,) = result["rows"], result["summary"]
    assert row["idle_report_interval_s"] == summary["idle_report_interval_s"] == 0.5
    assert row["host_cores"] > 0 and row["workers"] > 0 and row["cls"] > 0  # the cluster's processes are found
    assert "| 0.5 | 1 |" in done.stdout
    done = run_script("bench_idle", "--idle-intervals", "0.05")
    assert done.returncode == 2 and "at least --report-interval" in done.stderr
