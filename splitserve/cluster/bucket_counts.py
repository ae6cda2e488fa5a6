"""Values counted into a histogram's buckets where they are observed (`BucketCounts`), and a
Prometheus histogram fed such counts whole (`CountedHistogram`). The ingress counts a request's
times between tokens this way: the CLS then adds a request's ~16 counts to its histogram, not
each of a long answer's thousands of gaps, one `observe` at a time on its event loop."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


@dataclass
class BucketCounts:
    """`counts[i]`: values in (bounds[i-1], bounds[i]] (Prometheus's `le` bounds are inclusive);
    the last: values above every bound. Not cumulative."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def over(cls, bounds: tuple[float, ...]) -> BucketCounts:
        return cls(bounds, [0] * (len(bounds) + 1))

    def add(self, value: float, times: int = 1) -> None:
        """`value`, `times` times over."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        """0.0 with nothing counted."""
        return self.total / self.count if self.count else 0.0


class CountedHistogram:
    """A histogram in `registry` (one series per label values) that takes `BucketCounts` over its
    own bounds; scraped exactly as prometheus_client's `Histogram` fed each value would be."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...],
                 registry: CollectorRegistry):
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self._series: dict[tuple[str, ...], BucketCounts] = {}
        registry.register(self)

    def start(self, label_values: tuple[str, ...]) -> None:
        """The series at zero, as prometheus_client's `labels()` starts one."""
        self._series.setdefault(label_values, BucketCounts.over(self.bounds))

    def add(self, label_values: tuple[str, ...], counted: BucketCounts) -> None:
        if counted.bounds != self.bounds:
            raise ValueError(f"{self.name}: counts over bounds {counted.bounds}, the histogram's are {self.bounds}")
        self.start(label_values)
        series = self._series[label_values]
        series.counts = [a + b for a, b in zip(series.counts, counted.counts)]
        series.total += counted.total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc, labels=self.labels)]

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for label_values, series in self._series.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), series.counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(label_values), buckets, series.total)
        return [family]
