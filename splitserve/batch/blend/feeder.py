"""What an offline batch admits next, in one of three orders, for any executor (an engine's
step loop or a cluster's request loop):

- `fcfs`: the input order;
- `dfs`: a depth-first walk of the prefix tree (best prefix sharing, no resource balance);
- `blend`: BlendServe. First a sample of requests runs (DFS) to learn output lengths; then the
  tree is annotated, layer-sorted and cut into units, and the dual scanner admits from both ends
  within its memory shares.

Every order holds back a request that shares a full KV block with a prompt still being
prefilled, so it finds that prefix in the prefix cache (intra-batch sharing) instead of
computing it again alongside.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.batch.blend.cost import ACCELERATORS, CostModel, ModelShape
from splitserve.batch.blend.order import BlendOrder, blend_order
from splitserve.batch.blend.scanner import LEFT, RIGHT, DualScanner, Walk
from splitserve.batch.blend.tree import (
    Node,
    OfflineRequest,
    annotate,
    build_tree,
    common_prefix,
    estimate_outputs,
    layer_sort,
    pick_samples,
)

ORDERS = ("blend", "dfs", "fcfs")


@dataclass(frozen=True)
class BlendOptions:
    order: str = "blend"
    sample_fraction: float = 0.01  # p: requests run first to learn output lengths (§3.2)
    split_threshold: float = 0.01  # Algorithm 2's recompute budget t, as a fraction of the unique prompt tokens
    memory_fraction: float = 0.9   # of the executor's KV tokens the scanner hands out
    accelerator: str = "a100"      # the cost model's FLOP/s and bytes/s (they scale rho, not the order)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}")
        for name, low, high in (("sample_fraction", 0, 1), ("split_threshold", 0, 1), ("memory_fraction", 0, 1)):
            value = getattr(self, name)
            open_low = name == "memory_fraction"
            if not (isinstance(value, (int, float)) and low <= value <= high) or (open_low and value == 0):
                raise ValueError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}")


class BatchFeeder:
    """Drive it with `admit()` (requests to start now), `prefilled(key)` when a request's first
    token arrives and `finished(key, output_tokens)` when it ends, until `done`."""

    def __init__(self, requests: list[OfflineRequest], options: BlendOptions, model: ModelShape,
                 memory_tokens: float, block_size: int, finished: dict[int, int] | None = None):
        """`finished`: output tokens of requests already done (a resumed batch), over all their
        choices; they are not run again and serve as the samples."""
        if block_size < 1 or memory_tokens <= 0:
            raise ValueError(f"block_size must be >= 1 and memory_tokens > 0, got {block_size}, {memory_tokens}")
        self.options, self.block_size = options, block_size
        self.cost = CostModel(model, ACCELERATORS[options.accelerator])
        self.memory = memory_tokens * options.memory_fraction
        self.tree = build_tree(requests)
        self.order: BlendOrder | None = None
        self._choices = {request.key: request.choices for request in requests}
        self.measured: dict[int, float] = {key: tokens / self._choices[key] for key, tokens in (finished or {}).items()}
        self._loads = {LEFT: 0.0, RIGHT: 0.0}
        self._flight: dict[int, tuple[str, float]] = {}  # key -> (side, charge)
        self._prefilling: dict[int, tuple[int, ...]] = {}
        self._last: dict[str, tuple[int, ...]] = {}  # side -> prompt last admitted there
        leaves = list(self.tree.leaves())  # DFS order
        if options.order == "blend":
            sampled = self.measured or {r.key for r in pick_samples(self.tree, options.sample_fraction, options.seed)}
            leaves = [leaf for leaf in leaves if leaf.request.key in sampled]
        elif options.order == "fcfs":
            leaves.sort(key=lambda leaf: leaf.request.key)
        self._source = Walk([leaf for leaf in leaves if leaf.request.key not in self.measured], self.memory)

    @property
    def done(self) -> bool:
        return self._source.done and not self._flight and (self.order is not None or self.options.order != "blend")

    @property
    def in_flight(self) -> list[int]:
        return list(self._flight)

    @property
    def blend_due(self) -> bool:
        """The next `admit` orders the batch (every sample has run): the costly one, about 0.7 s
        for 50,000 requests."""
        return self.options.order == "blend" and self.order is None and self._source.done and not self._flight

    def admit(self) -> list[OfflineRequest]:
        if self.blend_due:
            self._start_blend()
        taken = self._source.admit(self._loads, self._charge, self._gated, self._took)
        return [leaf.request for leaf, _ in taken]

    def prefilled(self, key: int) -> None:
        self._prefilling.pop(key, None)

    def finished(self, key: int, output_tokens: int) -> None:
        """`output_tokens`: over all of the request's choices."""
        side, charge = self._flight.pop(key)
        self._prefilling.pop(key, None)
        self._loads[side] = max(0.0, self._loads[side] - charge)
        self.measured[key] = output_tokens / self._choices[key]

    # ---- internals -------------------------------------------------------------------
    def _took(self, leaf: Node, side: str, charge: float) -> None:
        self._flight[leaf.request.key] = (side, charge)
        self._prefilling[leaf.request.key] = leaf.request.prompt
        self._last[side] = leaf.request.prompt

    def _start_blend(self) -> None:
        """Output lengths are known for the samples: estimate the rest, annotate, sort, cut, scan."""
        estimate_outputs(self.tree, self.measured)
        annotate(self.tree, self.cost)
        layer_sort(self.tree)
        self.order = blend_order(self.tree, self.cost, self.options.split_threshold * self.tree.stats.unique_prompt)
        positions = [p for p, leaf in enumerate(self.order.leaves) if leaf.request.key not in self.measured]
        self._source = DualScanner(self.order, self.memory, positions) if positions else Walk([], self.memory)

    def _charge(self, leaf: Node, side: str) -> float:
        """KV tokens the request will hold: its prompt beyond what it shares with the last prompt
        admitted on its side, plus (blend, once estimated) every choice's output."""
        prompt = leaf.request.prompt
        return len(prompt) - common_prefix(self._last.get(side, ()), prompt) + leaf.request.choices * leaf.output

    def _gated(self, leaf: Node, side: str) -> bool:
        prompt = leaf.request.prompt
        return len(prompt) > self.block_size and any(
            common_prefix(other, prompt) >= self.block_size for other in self._prefilling.values())
