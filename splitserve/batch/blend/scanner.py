"""The dual scanner (§3.4): one cursor walks the blend order from the compute-heavy front, one
from the memory-heavy back, and KV memory is split between them so that the running mix has
the whole workload's density rho(root): M_L rho_L + M_R rho_R = M rho(root), M_L + M_R = M.

Each cursor walks a local DFS, so prefix sharing survives with one extra cached path. A side
is admitted a request while its load plus the request's charge fits its share; when nothing is
in flight the next request goes in regardless, so one request larger than a share still runs.
"""
from __future__ import annotations

from collections.abc import Callable

from splitserve.batch.blend.cost import partition
from splitserve.batch.blend.order import BlendOrder
from splitserve.batch.blend.tree import Node

LEFT, RIGHT = "left", "right"
Charge = Callable[[Node, str], float]
Gate = Callable[[Node, str], bool]


class _Source:
    """Requests taken from one or two ends (`sides`), each side within its KV share."""

    sides: tuple[str, ...]

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def peek(self, side: str) -> Node:
        raise NotImplementedError

    def take(self, side: str) -> Node:
        raise NotImplementedError

    def shares(self) -> tuple[float, ...]:
        """The KV tokens each side may hold now, in the order of `sides`."""
        raise NotImplementedError

    def admit(self, loads: dict[str, float], charge: Charge, gated: Gate = lambda leaf, side: False,
              on_take: Callable[[Node, str, float], None] = lambda leaf, side, cost: None) -> list[tuple[Node, str]]:
        """Take requests while they fit their side's share. `loads[side]` (KV tokens held by
        that side's admitted requests) is updated in place; `charge(leaf, side)` is the KV a
        request will add; a `gated` request waits (e.g. for a prefix still being computed);
        `on_take` hears of each request as it is taken, before the next is charged."""
        taken: list[tuple[Node, str]] = []
        moved = True
        while moved and not self.done:
            moved = False
            for side, share in zip(self.sides, self.shares()):
                if self.done:
                    break
                leaf = self.peek(side)
                if gated(leaf, side):
                    continue
                cost = charge(leaf, side)
                idle = not taken and not any(loads.values())
                if loads[side] + cost <= share or idle:
                    self.take(side)
                    loads[side] += cost
                    taken.append((leaf, side))
                    on_take(leaf, side, cost)
                    moved = True
        return taken


class Walk(_Source):
    """A fixed sequence taken front to back within one budget (fcfs, dfs, the samples)."""

    sides = (LEFT,)

    def __init__(self, leaves: list[Node], memory_tokens: float):
        self.leaves, self.memory, self.next = leaves, float(memory_tokens), 0

    @property
    def done(self) -> bool:
        return self.next >= len(self.leaves)

    def peek(self, side: str) -> Node:
        return self.leaves[self.next]

    def take(self, side: str) -> Node:
        self.next += 1
        return self.leaves[self.next - 1]

    def shares(self) -> tuple[float, ...]:
        return (self.memory,)


class DualScanner(_Source):
    sides = (LEFT, RIGHT)

    def __init__(self, order: BlendOrder, memory_tokens: float, positions: list[int] | None = None):
        """`positions`: the part of the order to scan (default all of it)."""
        if memory_tokens <= 0:
            raise ValueError(f"memory_tokens must be > 0, got {memory_tokens}")
        self.order, self.memory = order, float(memory_tokens)
        self.positions = list(range(len(order.leaves))) if positions is None else list(positions)
        self.lo, self.hi = 0, len(self.positions) - 1

    @property
    def done(self) -> bool:
        return self.lo > self.hi

    @property
    def remaining(self) -> int:
        return max(0, self.hi - self.lo + 1)

    def peek(self, side: str) -> Node:
        return self.order.leaves[self.positions[self.lo if side == LEFT else self.hi]]

    def take(self, side: str) -> Node:
        leaf = self.peek(side)
        if side == LEFT:
            self.lo += 1
        else:
            self.hi -= 1
        return leaf

    def densities(self) -> tuple[float, float]:
        """rho of the units under the two cursors; inside one unit, of the two subtrees where
        the cursors' paths part (the finest nodes that still tell the sides apart)."""
        left, right = self.positions[self.lo], self.positions[self.hi]
        units, unit_of = self.order.units, self.order.unit_of
        if unit_of[left] != unit_of[right]:
            return units[unit_of[left]].rho, units[unit_of[right]].rho
        a, b = _below_common_ancestor(self.order.leaves[left], self.order.leaves[right])
        return a.rho, b.rho

    def shares(self) -> tuple[float, float]:
        """(M_L, M_R): the KV tokens each side may hold now."""
        if self.remaining <= 1:
            return self.memory, 0.0
        return partition(self.memory, *self.densities(), self.order.root_rho)


def _below_common_ancestor(a: Node, b: Node) -> tuple[Node, Node]:
    """The children of the lowest common ancestor of two distinct leaves on the paths to each."""
    seen: dict[int, Node] = {}
    node, child = a, a
    while node is not None:
        seen[id(node)] = child
        child, node = node, node.parent
    node, child = b, b
    while id(node) not in seen:
        child, node = node, node.parent
    return seen[id(node)], child
