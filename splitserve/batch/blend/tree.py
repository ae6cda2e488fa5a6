"""BlendServe's resource-aware prefix tree (§3.1-3.3): a compressed trie of every prompt whose
leaves are the requests, each node carrying its subtree's compute density.

Invariants: a node's `depth` is the length of the prompt prefix from the root to its end; a leaf
holds exactly one request and its depth is that request's prompt length; every internal node has
at least one leaf below it. Aggregates (`Stats`) are sums over the leaves below a node, except
`unique_prompt`, the prompt tokens computed once when the subtree runs alone in DFS order
(the path to the node plus every edge below it).
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from splitserve.batch.blend.cost import CostModel


@dataclass(frozen=True)
class OfflineRequest:
    key: int  # the caller's index for it
    prompt: tuple[int, ...]
    max_tokens: int
    known_output: int | None = None  # the exact output length of each choice, when the request fixes it
    choices: int = 1  # sequences decoded from the one prefill (`n`, `best_of`), each with its own output

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.key}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.key}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.choices < 1:
            raise ValueError(f"request {self.key}: choices must be >= 1, got {self.choices}")


@dataclass
class Stats:
    requests: int = 0
    prompt: float = 0.0          # sum p
    prompt_squares: float = 0.0  # sum p^2 (prefill attention)
    output: float = 0.0          # sum d (estimated)
    kv_reads: float = 0.0        # sum (p d + d^2 / 2): decode attention's KV token reads
    unique_prompt: float = 0.0

    def add(self, other: "Stats") -> None:
        self.requests += other.requests
        self.prompt += other.prompt
        self.prompt_squares += other.prompt_squares
        self.output += other.output
        self.kv_reads += other.kv_reads

    def sharing(self) -> float:
        """The prefix-sharing ratio s = 1 - unique / total prompt tokens."""
        return 1.0 - self.unique_prompt / self.prompt if self.prompt else 0.0

    def density(self, cost: CostModel) -> float:
        """rho(R) = (1 - s) T_comp / T_mem (§2.4), as the paper defines it: sharing discounts all of
        the compute (it reproduces Table 3's MMLU density); memory is not discounted (no cascade
        attention)."""
        compute = cost.compute_s(self.prompt, self.output, prompt_squares=self.prompt_squares)
        return (1 - self.sharing()) * compute / cost.kv_read_s(self.kv_reads) if self.kv_reads else float("inf")


@dataclass(eq=False)
class Node:
    depth: int
    parent: "Node | None" = None
    children: list["Node"] = field(default_factory=list)
    request: OfflineRequest | None = None  # set on leaves only
    output: float = 0.0  # a leaf's output length: known, sampled or estimated
    stats: Stats = field(default_factory=Stats)
    rho: float = 0.0

    @property
    def is_leaf(self) -> bool:
        return self.request is not None

    @property
    def edge(self) -> int:
        return self.depth - (self.parent.depth if self.parent else 0)

    def leaves(self) -> Iterator["Node"]:
        """The requests below, in DFS order of the current child order."""
        stack = [self]
        while stack:
            node = stack.pop()
            if node.is_leaf:
                yield node
            stack.extend(reversed(node.children))

    def nodes(self) -> Iterator["Node"]:
        """Every node below, children after their parent."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)


def build_tree(requests: list[OfflineRequest]) -> Node:
    """The compressed trie, built from the prompts in sorted order with a stack of the current
    path: consecutive prompts share their longest common prefix, so O(N log N) comparisons."""
    root = Node(0)
    path = [root]
    previous: tuple[int, ...] = ()
    for request in sorted(requests, key=lambda r: (r.prompt, r.key)):
        shared = common_prefix(previous, request.prompt)
        popped = None
        while path[-1].depth > shared or path[-1].is_leaf:
            popped = path.pop()
        top = path[-1]
        if top.depth < shared:  # the new prompt leaves `popped`'s edge part-way: split it there
            middle = Node(shared, top)
            top.children[top.children.index(popped)] = middle
            middle.children.append(popped)
            popped.parent = middle
            path.append(middle)
            top = middle
        leaf = Node(len(request.prompt), top, request=request)
        top.children.append(leaf)
        path.append(leaf)
        previous = request.prompt
    return root


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the longest common prefix (binary search over slice equality, done in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pick_samples(root: Node, fraction: float, seed: int = 0) -> list[OfflineRequest]:
    """The requests to run first to learn output lengths (§3.2): each unknown-length request
    with probability `fraction`, at least one when any length is unknown; in DFS order."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"sample fraction must be in [0, 1], got {fraction}")
    unknown = [leaf.request for leaf in root.leaves() if leaf.request.known_output is None]
    rng = random.Random(seed)
    picked = [r for r in unknown if rng.random() < fraction]
    return picked or unknown[:1]


def estimate_outputs(root: Node, measured: dict[int, float]) -> None:
    """Set every leaf's output length per choice: known, measured (sampled, by request key, per
    choice), else the mean of the samples in the deepest enclosing subtree that has any (siblings'
    samples included); with no samples at all, max_tokens. Always capped to [1, max_tokens]."""
    samples: dict[int, tuple[int, float]] = {}  # id(node) -> (count, sum) of samples below
    for node in reversed(list(root.nodes())):  # children before parents
        if node.is_leaf:
            value = measured.get(node.request.key)
            samples[id(node)] = (0, 0.0) if value is None else (1, float(value))
        else:
            below = [samples[id(child)] for child in node.children]
            samples[id(node)] = (sum(c for c, _ in below), sum(t for _, t in below))
    for leaf in root.leaves():
        request = leaf.request
        value = request.known_output if request.known_output is not None else measured.get(request.key)
        node = leaf.parent
        while value is None and node is not None:
            count, total = samples[id(node)]
            value = total / count if count else None
            node = node.parent
        leaf.output = min(float(request.max_tokens), max(1.0, float(request.max_tokens if value is None else value)))


def annotate(root: Node, cost: CostModel) -> None:
    """Subtree aggregates and rho, children before parents (after `estimate_outputs`)."""
    edges_below: dict[int, float] = {}
    for node in reversed(list(root.nodes())):
        if node.is_leaf:
            p, d, c = float(node.depth), node.output, node.request.choices  # the prompt is prefilled once
            stats, below = Stats(1, p, p * p, c * d, c * (p * d + d * d / 2)), 0.0
        else:
            stats, below = Stats(), 0.0
            for child in node.children:
                below += child.edge + edges_below.pop(id(child))
                stats.add(child.stats)
        edges_below[id(node)] = below
        stats.unique_prompt = node.depth + below
        node.stats, node.rho = stats, stats.density(cost)


def layer_sort(root: Node) -> None:
    """Algorithm 1: every node's children in descending rho (stable), compute-heavy on the left.
    Only siblings move, so every DFS over the tree shares prefixes as before."""
    for node in root.nodes():
        node.children.sort(key=lambda child: -child.rho)
