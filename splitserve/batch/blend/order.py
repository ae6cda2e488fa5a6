"""From the annotated prefix tree to the sequence the dual scanner walks (§3.3).

Algorithm 2 cuts the layer-sorted tree into units (subtrees run as one local DFS) wherever the
prefix recomputed by separating a node's children stays under a budget; units are sorted by
rho, adjacent siblings merged back (no extra recompute, less fragmentation), and their requests
laid out in one sequence: compute-heavy at the front, memory-heavy at the back.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.batch.blend.cost import CostModel
from splitserve.batch.blend.tree import Node, Stats


@dataclass
class Unit:
    nodes: list[Node]  # one subtree, or adjacent siblings merged
    rho: float

    @property
    def parent(self) -> Node | None:
        return self.nodes[0].parent


@dataclass
class BlendOrder:
    leaves: list[Node]   # every request, compute-heavy first; each unit's requests contiguous, in DFS order
    unit_of: list[int]   # position -> index into units
    units: list[Unit]
    root_rho: float      # the whole workload's density: the blend's target


def node_split(root: Node, threshold: float) -> list[Node]:
    """Algorithm 2: keep `node` whole when separating its children would recompute more than the
    budget (its prefix length x its number of children); else recurse, the budget split evenly.
    Leaves are units (the paper's pseudocode drops them); the root (prefix 0) always splits."""
    if threshold < 0:
        raise ValueError(f"split threshold must be >= 0, got {threshold}")
    units, stack = [], [(root, float(threshold))]
    while stack:
        node, budget = stack.pop()
        if node.is_leaf or not node.children or node.depth * len(node.children) > budget:
            units.append(node)
        else:
            share = budget / len(node.children)
            stack.extend((child, share) for child in reversed(node.children))
    return units


def merge_units(nodes: list[Node], cost: CostModel) -> list[Unit]:
    """Runs of adjacent units with one parent become one unit (their DFS stays contiguous)."""
    units: list[Unit] = []
    for node in nodes:
        if units and units[-1].parent is node.parent and node.parent is not None:
            units[-1].nodes.append(node)
        else:
            units.append(Unit([node], node.rho))
    for unit in units:
        if len(unit.nodes) > 1:
            unit.rho = _merged(unit).density(cost)
    return units


def _merged(unit: Unit) -> Stats:
    stats, base = Stats(), unit.parent.depth
    stats.unique_prompt = base
    for node in unit.nodes:
        stats.add(node.stats)
        stats.unique_prompt += node.stats.unique_prompt - base
    return stats


def blend_order(root: Node, cost: CostModel, threshold: float) -> BlendOrder:
    """The scan sequence of a layer-sorted, annotated tree."""
    split = sorted(node_split(root, threshold), key=lambda node: -node.rho)  # stable: DFS order on ties
    units = sorted(merge_units(split, cost), key=lambda unit: -unit.rho)  # a merged unit's rho moved
    leaves, unit_of = [], []
    for index, unit in enumerate(units):
        for node in unit.nodes:
            for leaf in node.leaves():
                leaves.append(leaf)
                unit_of.append(index)
    return BlendOrder(leaves, unit_of, units, root.rho)
