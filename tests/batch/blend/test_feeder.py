"""The feeder's memory model for requests with several choices (`n`, `best_of`): the prompt is
charged once, every choice's output on its own, and a measured output is per choice."""
from __future__ import annotations

import pytest

from splitserve.batch.blend.cost import ModelShape
from splitserve.batch.blend.feeder import BatchFeeder, BlendOptions
from splitserve.batch.blend.tree import OfflineRequest

SHAPE = ModelShape(8.03e9, 4096, 1024, 32)
FULL = BlendOptions(memory_fraction=1.0)


@pytest.mark.parametrize("choices, admitted", [(1, 2), (4, 1)])
def test_every_choice_holds_its_own_output(choices, admitted):
    """Two alike requests of 10 prompt tokens and 10 output tokens per choice; 80 KV tokens,
    split evenly between the scanner's sides (equal densities): 10 + 10 fits a side, 10 + 4 x 10
    does not, so only the first (admitted into an idle feeder whatever its size) runs."""
    requests = [OfflineRequest(key, tuple(range(key * 10, key * 10 + 10)), 10, known_output=10, choices=choices)
                for key in (0, 1)]
    feeder = BatchFeeder(requests, FULL, SHAPE, 80, 16)
    assert len(feeder.admit()) == admitted
    assert feeder.tree.stats.output == 2 * choices * 10


def test_a_measured_output_is_per_choice_for_the_estimates():
    four = OfflineRequest(0, (1, 2, 3), 100, choices=4)
    one = OfflineRequest(1, (1, 2, 4), 100)
    feeder = BatchFeeder([four, one], BlendOptions(sample_fraction=0), SHAPE, 10_000, 16)
    assert [r.key for r in feeder.admit()] == [0]  # the sample (first in DFS order)
    feeder.finished(0, 40)  # its four choices together
    assert [r.key for r in feeder.admit()] == [1]
    assert {leaf.request.key: leaf.output for leaf in feeder.tree.leaves()} == {0: 10, 1: 10}
    assert feeder.tree.stats.output == 4 * 10 + 10


def test_a_resumed_batch_divides_its_finished_outputs_by_their_choices():
    requests = [OfflineRequest(0, (1, 2, 3), 100, choices=4), OfflineRequest(1, (1, 2, 4), 100)]
    feeder = BatchFeeder(requests, BlendOptions(), SHAPE, 10_000, 16, finished={0: 40})
    assert feeder.measured == {0: 10} and [r.key for r in feeder.admit()] == [1]
    assert {leaf.request.key: leaf.output for leaf in feeder.tree.leaves()}[1] == 10


def test_choices_must_be_positive():
    with pytest.raises(ValueError, match="choices"):
        OfflineRequest(0, (1,), 5, choices=0)
