"""Runners: many searches driven at once give each the answer it gets alone, whatever order their
jobs finish in."""
import math

import pytest

from splitserve.jobs import Job, SerialRunner


class Shuffled(SerialRunner):
    """Runs each job when submitted but hands finished ones back newest first; claims `slots`."""

    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots

    def _next_done(self, handles: list):
        return self._done.pop()


def halving(start: float):
    """A search that asks for the square root of its value until it is 2 or less; answers how many it asked."""
    asked, value = 0, start
    while value > 2:
        value = yield Job(math.sqrt, (value,))
        asked += 1
    return asked


@pytest.mark.parametrize("runner", [SerialRunner(), Shuffled(3)], ids=["serial", "shuffled"])
def test_each_search_gets_its_own_answer(runner):
    seen = []
    assert runner.drive([halving(2.0 ** 16), halving(1.0), halving(9.0)], seen.append) == [4, 0, 2]
    assert sorted(seen) == sorted([256.0, 16.0, 4.0, 2.0, 3.0, math.sqrt(3.0)])
    assert runner.map([Job(math.sqrt, (x,)) for x in (4.0, 9.0, 16.0)]) == [2.0, 3.0, 4.0]


def test_a_search_that_fails_raises():
    with pytest.raises(ValueError, match="math domain error"):
        SerialRunner().map([Job(math.sqrt, (-1.0,))])
