"""Counts made where values are observed, added whole to a histogram: scraped exactly as
prometheus_client's own Histogram fed each value one at a time."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.bucket_counts import BucketCounts, CountedHistogram
from splitserve.cluster.metrics import LATENCY_BUCKETS


def scraped(registry: CollectorRegistry) -> dict[tuple, float]:
    """(sample name, labels) -> value, leaving out prometheus_client's `_created` stamps."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}


def test_counted_requests_scrape_as_each_value_observed():
    rng = random.Random(0)
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = CountedHistogram("gaps_seconds", "Gaps", ("model", "pool"), LATENCY_BUCKETS, ours_registry)
    theirs = Histogram("gaps_seconds", "Gaps", ("model", "pool"), buckets=LATENCY_BUCKETS, registry=theirs_registry)
    ours.start(("a", "token"))
    theirs.labels("a", "token")
    for request in range(40):
        labels = ("a", "token") if request % 3 else ("b", "mixed")
        counted = BucketCounts.over(LATENCY_BUCKETS)
        values = [rng.choice([0.0, 0.001, 0.01, 60, 61.5]) if rng.random() < 0.2 else rng.expovariate(20)
                  for _ in range(rng.randrange(50))]  # bounds themselves, beyond the last, and none at all
        for value in values:
            counted.add(value)
            theirs.labels(*labels).observe(value)
        counted.add(0.0, 7)  # a delta's 8 tokens left at once
        for _ in range(7):
            theirs.labels(*labels).observe(0.0)
        ours.add(labels, counted)
    mine, reference = scraped(ours_registry), scraped(theirs_registry)
    assert mine.keys() == reference.keys()
    assert all(mine[key] == pytest.approx(reference[key]) for key in reference)


def test_counts_over_other_bounds_are_refused():
    histogram = CountedHistogram("x_seconds", "X", ("model",), (0.1, 1.0), CollectorRegistry())
    with pytest.raises(ValueError, match="bounds"):
        histogram.add(("a",), BucketCounts.over((0.1, 2.0)))


def test_mean_and_count():
    counted = BucketCounts.over((0.1, 1.0))
    assert (counted.count, counted.mean) == (0, 0.0)
    counted.add(0.5)
    counted.add(2.0, 3)
    assert counted.counts == [0, 1, 3] and counted.count == 4 and counted.mean == pytest.approx(6.5 / 4)
