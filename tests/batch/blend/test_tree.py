"""The resource-aware prefix tree on hand-made prompts: structure, sharing, output-length
estimation by sampling, and the layer-wise sort (Algorithm 1)."""
from __future__ import annotations

import random

import pytest

from splitserve.batch.blend.cost import CostModel, ModelShape
from splitserve.batch.blend.tree import (
    OfflineRequest,
    annotate,
    build_tree,
    common_prefix,
    estimate_outputs,
    layer_sort,
    pick_samples,
)

COST = CostModel(ModelShape(8.03e9, 4096, 1024, 32))


def req(key, prompt, max_tokens=100, known=None):
    return OfflineRequest(key, tuple(prompt), max_tokens, known)


def shape(node):
    return (node.depth, node.request.key if node.is_leaf else None, [shape(c) for c in node.children])


def test_compressed_trie_with_prefix_prompts_and_duplicates():
    root = build_tree([req(0, [1, 2, 3, 4]), req(1, [1, 2, 3, 5]), req(2, [1, 2]), req(3, [1, 2, 3, 4]), req(4, [9])])
    assert shape(root) == (0, None, [
        (2, None, [(2, 2, []), (3, None, [(4, None, [(4, 0, []), (4, 3, [])]), (4, 1, [])])]),
        (1, 4, [])])
    estimate_outputs(root, {})
    annotate(root, COST)
    assert root.stats.unique_prompt == 6  # 1 2 3 4 5 9
    assert root.stats.prompt == 15 and root.stats.sharing() == pytest.approx(1 - 6 / 15)
    assert [leaf.request.key for leaf in root.leaves()] == [2, 0, 3, 1, 4]


def test_common_prefix():
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((), (1,)) == 0 and common_prefix((5, 6), (5, 6)) == 2


def test_output_estimates_known_sampled_subtree_mean_then_siblings():
    a, b = [1] * 8, [2] * 8
    requests = [req(0, a + [10], known=7), req(1, a + [11]), req(2, a + [12]), req(3, a + [13]),
                req(4, b + [20]), req(5, b + [21, 1]), req(6, b + [21, 2]), req(7, [3, 3], max_tokens=50)]
    root = build_tree(requests)
    estimate_outputs(root, {1: 10, 2: 20, 5: 90})
    out = {leaf.request.key: leaf.output for leaf in root.leaves()}
    assert out[0] == 7                   # known
    assert (out[1], out[2]) == (10, 20)  # measured
    assert out[3] == 15                  # mean of its subtree's samples
    assert out[6] == 90 and out[4] == 90  # nearest subtree with a sample (its sibling's)
    assert out[7] == 40                  # nothing under its own node: the root's mean, (10 + 20 + 90) / 3
    estimate_outputs(root, {})
    assert {leaf.request.key: leaf.output for leaf in root.leaves()}[3] == 100  # no samples: max_tokens


def test_estimates_are_capped_to_max_tokens():
    root = build_tree([req(0, [1, 1], max_tokens=5), req(1, [1, 2], max_tokens=500)])
    estimate_outputs(root, {1: 300})
    assert [leaf.output for leaf in root.leaves()] == [5, 300]


def test_samples_are_a_seeded_fraction_and_never_empty():
    root = build_tree([req(i, [i % 7, i]) for i in range(1000)])
    picked = pick_samples(root, 0.05, seed=1)
    assert 25 < len(picked) < 80 and picked == pick_samples(root, 0.05, seed=1)
    assert len(pick_samples(root, 0.0)) == 1
    with pytest.raises(ValueError, match="sample fraction"):
        pick_samples(root, 1.5)


def random_workload(seed, n=200):
    rng = random.Random(seed)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    return [req(i, rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))],
                known=rng.choice([2, 8, 500, 2000]), max_tokens=2000) for i in range(n)]


def dfs_sharing(root):
    """Prompt tokens a DFS run finds already computed (the longest prefix shared with any earlier prompt
    equals the one shared with the previous prompt in DFS order)."""
    leaves, total, previous = list(root.leaves()), 0, ()
    for leaf in leaves:
        total += common_prefix(previous, leaf.request.prompt)
        previous = leaf.request.prompt
    return total


@pytest.mark.parametrize("seed", range(5))
def test_layer_sort_permutes_siblings_only_keeps_dfs_sharing_and_orders_by_density(seed):
    root = build_tree(random_workload(seed))
    estimate_outputs(root, {})
    annotate(root, COST)
    before = {id(n): {id(c) for c in n.children} for n in root.nodes()}
    shared = dfs_sharing(root)
    layer_sort(root)
    assert {id(n): {id(c) for c in n.children} for n in root.nodes()} == before
    assert dfs_sharing(root) == shared == root.stats.prompt - root.stats.unique_prompt
    for node in root.nodes():
        densities = [c.rho for c in node.children]
        assert densities == sorted(densities, reverse=True)


def test_bad_requests_name_the_problem():
    with pytest.raises(ValueError, match="prompt is empty"):
        OfflineRequest(0, (), 5)
    with pytest.raises(ValueError, match="max_tokens"):
        OfflineRequest(0, (1,), 0)
