"""Algorithm 2 (conditional node split), unit merging, the blend order and the dual scanner's
memory shares, on hand-made trees."""
from __future__ import annotations

import pytest

from splitserve.batch.blend.cost import CostModel, ModelShape
from splitserve.batch.blend.order import blend_order, node_split
from splitserve.batch.blend.scanner import LEFT, RIGHT, DualScanner
from splitserve.batch.blend.tree import OfflineRequest, annotate, build_tree, estimate_outputs, layer_sort
from tests.batch.blend.test_tree import random_workload

COST = CostModel(ModelShape(8.03e9, 4096, 1024, 32))


def prepared(requests):
    root = build_tree(requests)
    estimate_outputs(root, {})
    annotate(root, COST)
    layer_sort(root)
    return root


def two_families():
    """Prefix A (100 tokens) x 3 short-output requests, prefix B (100 tokens) x 3 long-output ones."""
    a, b = list(range(100)), list(range(1000, 1100))
    return [OfflineRequest(i, tuple(a + [200 + i]), 4, 4) for i in range(3)] + \
        [OfflineRequest(3 + i, tuple(b + [300 + i]), 4000, 4000) for i in range(3)]


def test_node_split_keeps_a_node_whose_split_costs_more_than_the_budget():
    root = prepared(two_families())
    # each family node: prefix 100 x 3 children = 300 recomputed tokens; budget per family = t / 2
    assert [len(list(u.leaves())) for u in node_split(root, 599)] == [3, 3]
    assert [len(list(u.leaves())) for u in node_split(root, 600)] == [1] * 6
    assert all(u.is_leaf for u in node_split(root, 600))  # leaves become units (the paper's pseudocode drops them)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threshold", [0, 50, 500, 10**6])
def test_units_hold_every_request_once_and_the_order_is_density_sorted(seed, threshold):
    root = prepared(random_workload(seed))
    units = node_split(root, threshold)
    keys = [leaf.request.key for unit in units for leaf in unit.leaves()]
    assert sorted(keys) == list(range(200))
    recomputed = sum(u.parent.depth for u in units if u.parent is not None and u.parent is not root)
    assert recomputed <= threshold or threshold == 0
    order = blend_order(root, COST, threshold)
    assert sorted(leaf.request.key for leaf in order.leaves) == list(range(200))
    rhos = [order.units[i].rho for i in order.unit_of]
    assert rhos == sorted(rhos, reverse=True)
    assert order.root_rho == root.rho


def test_merge_joins_adjacent_sibling_units():
    root = prepared(two_families())
    order = blend_order(root, COST, 600)
    assert len(order.units) == 2 and [len(u.nodes) for u in order.units] == [3, 3]
    assert order.units[0].rho > root.rho > order.units[1].rho


def test_scanner_starts_at_both_ends_and_splits_memory_to_the_root_density():
    root = prepared(two_families())
    order = blend_order(root, COST, 600)
    scanner = DualScanner(order, 10_000)
    assert scanner.peek(LEFT).request.key in (0, 1, 2) and scanner.peek(RIGHT).request.key in (3, 4, 5)
    left, right = scanner.shares()
    rho_l, rho_r = scanner.densities()
    assert left + right == 10_000 and left * rho_l + right * rho_r == pytest.approx(10_000 * root.rho)


def test_scanner_admits_within_shares_and_always_makes_progress():
    root = prepared(two_families())
    scanner = DualScanner(blend_order(root, COST, 600), 5_000)
    loads = {LEFT: 0.0, RIGHT: 0.0}
    taken = scanner.admit(loads, lambda leaf, side: len(leaf.request.prompt) + leaf.output)
    sides = [side for _, side in taken]
    assert LEFT in sides and RIGHT in sides
    left, right = scanner.shares()
    assert loads[LEFT] <= left + 1e-9 or sides.count(LEFT) == 1
    big = DualScanner(blend_order(root, COST, 600), 10)  # every request exceeds its share
    assert len(big.admit({LEFT: 0.0, RIGHT: 0.0}, lambda leaf, side: 1e9)) == 1


def test_scanner_waits_on_a_gated_side_and_finishes_every_request():
    root = prepared(two_families())
    scanner = DualScanner(blend_order(root, COST, 600), 1e9)
    taken = scanner.admit({LEFT: 0.0, RIGHT: 0.0}, lambda leaf, side: 1.0, lambda leaf, side: side == RIGHT)
    assert {side for _, side in taken} == {LEFT}
    rest = scanner.admit({LEFT: 0.0, RIGHT: 0.0}, lambda leaf, side: 1.0)
    assert sorted(leaf.request.key for leaf, _ in taken + rest) == list(range(6)) and scanner.done
