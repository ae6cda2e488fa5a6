"""The host block tables a step gathers equal the block manager's lists, cut to the step's width
and padded with 0, through appends, new allocations, sequences leaving and rows running out."""
import random

import pytest
import torch

from splitserve.engine.host_block_tables import HostBlockTables


def expected(tables: list[list[int]], width: int) -> list[list[int]]:
    return [(t + [0] * width)[:width] for t in tables]


def test_appends_and_a_new_allocation_are_mirrored():
    mirror = HostBlockTables(rows=4, columns=2)
    a, b = [3, 1], [7]
    assert mirror.gather(["a", "b"], [a, b], 2).tolist() == [[3, 1], [7, 0]]
    a += [9, 4]  # grown past the columns
    b.append(5)
    assert mirror.gather(["a", "b"], [a, b], 4).tolist() == [[3, 1, 9, 4], [7, 5, 0, 0]]
    a2 = [8]  # "a" freed and allocated anew (preempted): a new list, copied whole over a zeroed row
    assert mirror.gather(["b", "a"], [b, a2], 3).tolist() == [[7, 5, 0], [8, 0, 0]]
    assert mirror.gather(["a"], [a2], 1).dtype == torch.int64


def test_width_cuts_tables_holding_more_blocks_than_the_context():
    mirror = HostBlockTables()
    assert mirror.gather(["a", "b"], [[1, 2, 3], [4]], 2).tolist() == [[1, 2], [4, 0]]


def test_a_step_with_more_sequences_than_rows_grows_them():
    mirror = HostBlockTables(rows=2, columns=1)
    tables = [[i, i + 1] for i in range(5)]
    ids = [str(i) for i in range(5)]
    assert mirror.gather(ids, tables, 2).tolist() == tables


@pytest.mark.parametrize("seed", range(3))
def test_random_churn_matches_padded_lists(seed):
    """Sequences arrive, grow and leave (a reused id gets a new list); every step's gather equals
    the tables padded with 0 and cut to the step's width."""
    rng = random.Random(seed)
    mirror = HostBlockTables(rows=3, columns=2)
    live: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(300):
        if rng.random() < 0.3 or not live:
            seq_id = str(rng.randrange(next_id + 1))  # sometimes an id seen before: a new allocation
            next_id += 1
            live[seq_id] = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.2 and len(live) > 1:
            del live[rng.choice(list(live))]
        for table in live.values():
            if rng.random() < 0.4:
                table.append(rng.randrange(1000))
        ids = rng.sample(list(live), rng.randrange(1, len(live) + 1))
        tables = [live[i] for i in ids]
        width = max(1, max(len(t) for t in tables) - rng.randrange(2))
        assert mirror.gather(ids, tables, width).tolist() == expected(tables, width)
