"""The simulation's compact records: each `RequestRecord` as the client saw it, and a summary from
arrays that is the bench's summary of those records."""
import dataclasses
import json

import pytest

from splitserve.bench.report import summarize
from splitserve.placement import PlacementThresholds
from splitserve.sim.cluster import simulate
from splitserve.sim.records import SimRecords
from tests.sim.test_sim_cluster import CLUSTERS, random_requests, spec, split


@pytest.mark.parametrize("name", ["splitwise", "orca-only"])
def test_summary_from_arrays_is_the_summary_of_the_records(name):
    requests = [spec(i, 0.0, 4000, 3) for i in range(2)] + random_requests(200)[2:]  # two refused (400)
    result = simulate(CLUSTERS[name], requests)
    records = list(result.records)
    assert sum(r.status == 400 for r in records) == 2
    assert result.summary() == summarize(records, result.duration_s)


def test_each_priority_class_from_arrays_is_the_summary_of_its_records():
    """The sim's columns carry each request's priority and its gaps' owners: `by_priority` from
    them is the bench's from the records (which carry the priority each was sent with)."""
    requests = [dataclasses.replace(r, priority=r.index % 3 - 1) for r in random_requests(200)]
    result = simulate(split(scheduling_policy="priority"), requests)
    records = list(result.records)
    assert [r.priority for r in records] == [r.index % 3 - 1 for r in records]
    summary = result.summary()
    assert list(summary["by_priority"]) == ["-1", "0", "1"] and summary == summarize(records, result.duration_s)


def test_rejections_are_counted_and_records_read_back_in_index_order():
    thresholds = PlacementThresholds(max_queue_tokens=1000)
    requests = [spec(index, 0.001 * position, 600, 2) for position, index in enumerate((9, 3, 5, 1, 7))]
    result = simulate(split(placement="jsq", thresholds=thresholds), requests)
    assert [r.index for r in result.records] == [1, 3, 5, 7, 9]
    assert [r.status for r in result.records] == [429, 200, 429, 429, 200]  # the first two arrivals got in
    assert result.records[-1] == result.records[4] and json.dumps([r.tbt_s for r in result.records])
    with pytest.raises(IndexError):
        result.records[5]
    summary = result.summary()
    assert (summary["num_completed"], summary["num_rejected"]) == (2, 3)


def test_a_request_ends_once():
    records = SimRecords([spec(0, 0.0, 10, 2)])
    records.finish(0, [0.5, 0.75], delay_s=0.0, cached_tokens=0)
    with pytest.raises(RuntimeError, match="ended twice"):
        records.finish(0, [0.5, 0.75], delay_s=0.0, cached_tokens=0)
